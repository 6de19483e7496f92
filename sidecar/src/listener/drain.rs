//! One event loop's drain at shutdown: every connection it serves is
//! counted until it ends, and when the drain starts each is told to finish
//! what it holds and close (hyper's graceful shutdown: the answers in
//! flight, then the close or GOAWAY). A connection checks a flag each time
//! its task wakes; its waker waits in the loop's list so that the drain can
//! wake it. (hyper-util's `GracefulShutdown` does the same with a `Notify`
//! polled on every wake-up, about 280 instructions of each request's.)

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// A loop's connections and whether they are draining.
#[derive(Default)]
pub(super) struct Drain {
    draining: AtomicBool,
    open: AtomicUsize,
    /// Wakers of the connections being served, in reusable slots.
    wakers: Mutex<Wakers>,
    /// Told when the last connection ends while draining.
    ended: tokio::sync::Notify,
}

#[derive(Default)]
struct Wakers {
    slots: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl Drain {
    /// Counts a connection until the guard drops.
    pub(super) fn count(self: &Arc<Self>) -> Counted {
        self.open.fetch_add(1, Ordering::AcqRel);
        Counted(self.clone())
    }

    /// Tells every connection to finish and close, then waits until all
    /// have ended, or `within` has passed (false then).
    pub(super) async fn run(&self, within: Duration) -> bool {
        self.draining.store(true, Ordering::Release);
        let woken: Vec<Waker> = {
            let w = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
            w.slots.iter().flatten().cloned().collect()
        };
        woken.into_iter().for_each(Waker::wake);
        tokio::time::timeout(within, async {
            loop {
                let ended = self.ended.notified();
                tokio::pin!(ended);
                ended.as_mut().enable();
                if self.open.load(Ordering::Acquire) == 0 {
                    return;
                }
                ended.await;
            }
        })
        .await
        .is_ok()
    }

    fn register(&self, slot: Option<usize>, waker: &Waker) -> usize {
        let mut w = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        match slot {
            Some(i) => {
                w.slots[i] = Some(waker.clone());
                i
            }
            None => match w.free.pop() {
                Some(i) => {
                    w.slots[i] = Some(waker.clone());
                    i
                }
                None => {
                    w.slots.push(Some(waker.clone()));
                    w.slots.len() - 1
                }
            },
        }
    }

    fn unregister(&self, slot: usize) {
        let mut w = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        w.slots[slot] = None;
        w.free.push(slot);
    }
}

/// A connection counted for the drain (see [`Drain::count`]).
pub(super) struct Counted(Arc<Drain>);

impl Drop for Counted {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.ended.notify_waiters();
        }
    }
}

/// A connection that hyper can close gracefully.
pub(super) trait Graceful: Future {
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<C: hyper_util::server::graceful::GracefulConnection> Graceful for C {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        hyper_util::server::graceful::GracefulConnection::graceful_shutdown(self)
    }
}

/// Serves `conn`, counted by `counted`, until it ends; gracefully closed
/// once the drain starts.
pub(super) struct Drained<C> {
    conn: Pin<Box<C>>,
    counted: Counted,
    slot: Option<usize>,
    waker: Option<Waker>,
    closing: bool,
}

impl<C: Graceful> Drained<C> {
    pub(super) fn new(conn: C, counted: Counted) -> Drained<C> {
        Drained {
            conn: Box::pin(conn),
            counted,
            slot: None,
            waker: None,
            closing: false,
        }
    }
}

impl<C: Graceful> Future for Drained<C> {
    type Output = C::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = &mut *self;
        let drain = &this.counted.0;
        // Registered before the flag is read: a drain that starts after the
        // registration wakes this task, one that started before it is seen.
        if this.waker.as_ref().is_none_or(|w| !w.will_wake(cx.waker())) {
            this.slot = Some(drain.register(this.slot, cx.waker()));
            this.waker = Some(cx.waker().clone());
        }
        if !this.closing && drain.draining.load(Ordering::Acquire) {
            this.closing = true;
            this.conn.as_mut().graceful_shutdown();
        }
        this.conn.as_mut().poll(cx)
    }
}

impl<C> Drop for Drained<C> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            self.counted.0.unregister(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection that ends once told to close.
    struct Closable(bool);

    impl Future for Closable {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            if self.0 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }
    }

    impl Graceful for Closable {
        fn graceful_shutdown(mut self: Pin<&mut Self>) {
            self.0 = true;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_drain_closes_every_connection_and_waits_for_them() {
        let drain = Arc::new(Drain::default());
        let conns: Vec<_> = (0..3)
            .map(|_| tokio::spawn(Drained::new(Closable(false), drain.count())))
            .collect();
        tokio::task::yield_now().await;
        assert_eq!(drain.open.load(Ordering::Acquire), 3);
        assert!(drain.run(Duration::from_secs(5)).await);
        for c in conns {
            c.await.expect("ended");
        }
        assert_eq!(drain.open.load(Ordering::Acquire), 0);
        let w = drain.wakers.lock().unwrap_or_else(|p| p.into_inner());
        assert!(w.slots.iter().all(Option::is_none));
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_will_not_close_is_given_up_on_after_the_drain_time() {
        struct Stubborn;
        impl Future for Stubborn {
            type Output = ();
            fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
                Poll::Pending
            }
        }
        impl Graceful for Stubborn {
            fn graceful_shutdown(self: Pin<&mut Self>) {}
        }
        let drain = Arc::new(Drain::default());
        let _c = tokio::spawn(Drained::new(Stubborn, drain.count()));
        tokio::task::yield_now().await;
        assert!(!drain.run(Duration::from_secs(5)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_starts_during_the_drain_closes_at_once() {
        let drain = Arc::new(Drain::default());
        let counted = drain.count();
        let draining = {
            let drain = drain.clone();
            tokio::spawn(async move { drain.run(Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        Drained::new(Closable(false), counted).await;
        assert!(draining.await.expect("drain"));
    }
}
