//! The timer behind hyper's header read timeout (`--client-idle-timeout`):
//! hyper arms it every time a keep-alive connection starts waiting for a
//! request head, and drops it when the head arrives, so on tokio's timer
//! every request registered and removed a timer entry (about 500
//! instructions of the request's 22,000 in user space). Here a sleep is a
//! deadline and, once polled before it, a slot in its event loop's list;
//! each loop wakes the sleeps that are due every [`TICK`]. A client that
//! sends no whole head is closed up to a tick after its timeout.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// How often each event loop wakes the sleeps that are due.
pub const TICK: Duration = Duration::from_millis(250);

thread_local! {
    /// This event loop's sleeps waiting for their deadline.
    static WAITING: RefCell<Waiting> = RefCell::new(Waiting::default());
}

/// Sleeps waiting on one event loop, in reusable slots.
#[derive(Default)]
struct Waiting {
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Stamps slots, so that a sleep never takes another's slot for its own.
    next_stamp: u64,
}

struct Slot {
    deadline: tokio::time::Instant,
    waker: Waker,
    stamp: u64,
}

/// Where a sleep waits: its slot, the slot's stamp and the loop's list
/// (its address: a sleep dropped on another thread leaves the slot to be
/// swept at its deadline).
#[derive(Clone, Copy)]
struct Place {
    index: usize,
    stamp: u64,
    list: usize,
}

fn list_id(w: &RefCell<Waiting>) -> usize {
    w as *const RefCell<Waiting> as usize
}

/// hyper's timer: see the module's text. Its clock is tokio's, so that
/// tests on paused time drive it.
#[derive(Clone, Copy, Debug, Default)]
pub struct CoarseTimer;

impl hyper::rt::Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(self.now() + duration)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(CoarseSleep {
            deadline: tokio::time::Instant::from_std(deadline),
            place: None,
        })
    }

    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}

/// One sleep until a deadline.
struct CoarseSleep {
    deadline: tokio::time::Instant,
    place: Option<Place>,
}

impl hyper::rt::Sleep for CoarseSleep {}

impl Future for CoarseSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if tokio::time::Instant::now() >= self.deadline {
            self.leave();
            return Poll::Ready(());
        }
        let deadline = self.deadline;
        let place = self.place;
        self.place = Some(WAITING.with(|w| {
            let list = list_id(w);
            let mut w = w.borrow_mut();
            if let Some(p) = place.filter(|p| p.list == list) {
                if let Some(Some(slot)) = w.slots.get_mut(p.index) {
                    if slot.stamp == p.stamp {
                        if !slot.waker.will_wake(cx.waker()) {
                            slot.waker = cx.waker().clone();
                        }
                        return p;
                    }
                }
            }
            w.next_stamp += 1;
            let slot = Slot {
                deadline,
                waker: cx.waker().clone(),
                stamp: w.next_stamp,
            };
            let stamp = slot.stamp;
            let index = match w.free.pop() {
                Some(i) => {
                    w.slots[i] = Some(slot);
                    i
                }
                None => {
                    w.slots.push(Some(slot));
                    w.slots.len() - 1
                }
            };
            Place { index, stamp, list }
        }));
        Poll::Pending
    }
}

impl CoarseSleep {
    /// Gives its slot back, if it still holds one on this loop.
    fn leave(&mut self) {
        let Some(p) = self.place.take() else {
            return;
        };
        // During thread teardown the list may be gone: nothing to give back.
        let _ = WAITING.try_with(|w| {
            if list_id(w) != p.list {
                return;
            }
            let mut w = w.borrow_mut();
            if matches!(w.slots.get(p.index), Some(Some(s)) if s.stamp == p.stamp) {
                w.slots[p.index] = None;
                w.free.push(p.index);
            }
        });
    }
}

impl Drop for CoarseSleep {
    fn drop(&mut self) {
        self.leave();
    }
}

thread_local! {
    static SWEEPING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Starts [`wake_due_forever`] on this event loop unless it runs already.
/// Call it from a task of a single-threaded runtime: a sleep waits in the
/// list of the thread that polled it, and only that thread's task wakes it.
pub fn ensure_waking() {
    if !SWEEPING.with(|s| s.replace(true)) {
        tokio::spawn(wake_due_forever());
    }
}

/// Wakes the sleeps of this event loop that are due, every [`TICK`], for
/// as long as the loop runs.
pub async fn wake_due_forever() {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        wake_due(tokio::time::Instant::now());
    }
}

/// Wakes (and frees the slots of) the sleeps due by `now`.
fn wake_due(now: tokio::time::Instant) {
    let due: Vec<Waker> = WAITING.with(|w| {
        let mut w = w.borrow_mut();
        let Waiting { slots, free, .. } = &mut *w;
        let mut due = Vec::new();
        for (i, s) in slots.iter_mut().enumerate() {
            if s.as_ref().is_some_and(|s| s.deadline <= now) {
                if let Some(s) = s.take() {
                    due.push(s.waker);
                    free.push(i);
                }
            }
        }
        due
    });
    // Woken outside the borrow: a wake may poll (and drop) a sleep.
    for waker in due {
        waker.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer;

    fn waiting() -> usize {
        WAITING.with(|w| w.borrow().slots.iter().flatten().count())
    }

    #[tokio::test(start_paused = true)]
    async fn a_sleep_ends_within_a_tick_after_its_deadline_and_frees_its_slot() {
        tokio::spawn(wake_due_forever());
        let start = tokio::time::Instant::now();
        CoarseTimer.sleep(Duration::from_millis(600)).await;
        let slept = start.elapsed();
        assert!(
            slept >= Duration::from_millis(600) && slept <= Duration::from_millis(600) + TICK,
            "{slept:?}"
        );
        assert_eq!(waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_sleep_leaves_nothing_behind_and_its_slot_is_reused() {
        tokio::spawn(wake_due_forever());
        for _ in 0..3 {
            let mut s = CoarseTimer.sleep(Duration::from_secs(60));
            let pending = tokio::time::timeout(Duration::from_millis(10), s.as_mut()).await;
            assert!(pending.is_err());
            assert_eq!(waiting(), 1);
            drop(s);
            assert_eq!(waiting(), 0);
        }
        assert_eq!(WAITING.with(|w| w.borrow().slots.len()), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_already_past_is_ready_at_once() {
        let s = CoarseTimer.sleep_until(CoarseTimer.now());
        tokio::time::timeout(Duration::from_millis(1), s)
            .await
            .expect("ready at once");
        assert_eq!(waiting(), 0);
    }
}
