//! A listener's sockets: bound with SO_REUSEPORT, one per event loop, and
//! served on their loops (the first on the caller's runtime, each other on
//! a thread of its own).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::sync::watch;

use crate::proxy::Proxy;

/// Binds `n` listening sockets on `addr` with SO_REUSEPORT (the kernel
/// spreads new connections over them), or one plain socket when `n` is 1.
///
/// SO_REUSEPORT would also let another process of the same user join the
/// group: a second mesh's gateway on the same address would silently take
/// a share of the new connections. So the address is first bound once
/// without it, which fails, as a plain bind does, while anything listens
/// there.
pub(crate) fn bind_reuseport(
    addr: SocketAddr,
    n: usize,
) -> std::io::Result<Vec<tokio::net::TcpSocket>> {
    let socket = || {
        let s = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        s.set_reuseaddr(true)?;
        Ok::<_, std::io::Error>(s)
    };
    let in_use = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            std::io::Error::new(e.kind(), format!("{e}: another process listens there"))
        } else {
            e
        }
    };
    if n > 1 {
        socket()?.bind(addr).map_err(in_use)?;
    }
    (0..n.max(1))
        .map(|_| {
            let s = socket()?;
            if n > 1 {
                s.set_reuseport(true)?;
            }
            s.bind(addr).map_err(in_use)?;
            Ok(s)
        })
        .collect()
}

/// Serves `proxy` on each socket: the first on this runtime, each other on
/// a thread of its own with a single-threaded runtime (thread per core, as
/// nginx's workers: no work stealing, no cross-thread wake-ups per request).
/// Endpoint state and config are shared; each loop accepts its own
/// connections and hands one to another loop that serves fewer (see
/// [`super::Loops`]).
pub(crate) fn serve_on_loops(
    name: &'static str,
    sockets: Vec<tokio::net::TcpSocket>,
    loops: Arc<super::Loops>,
    (proxy, capture): (Arc<Proxy>, Option<Arc<super::captured::Capture>>),
    stop: &watch::Receiver<bool>,
    drain: std::time::Duration,
    servers: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<()> {
    const BACKLOG: u32 = 1024;
    for (i, socket) in sockets.into_iter().enumerate() {
        let (proxy, stop, loops) = (proxy.clone(), stop.clone(), loops.clone());
        let capture = capture.clone();
        if i == 0 {
            let listener = socket.listen(BACKLOG)?;
            servers.push(tokio::spawn(super::serve(
                name, listener, proxy, capture, stop, drain, loops, i,
            )));
            continue;
        }
        let thread = std::thread::Builder::new()
            .name(format!("{name}-{i}"))
            .spawn(move || {
                crate::pool::set_event_loop(i as u16);
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => return tracing::warn!(listener = name, error = %e, "cannot start an event loop"),
                };
                rt.block_on(async move {
                    match socket.listen(BACKLOG) {
                        Ok(listener) => super::serve(name, listener, proxy, capture, stop, drain, loops, i).await,
                        Err(e) => tracing::warn!(listener = name, error = %e, "cannot listen"),
                    }
                });
            })
            .context("starting an event-loop thread")?;
        servers.push(tokio::spawn(async move {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }));
    }
    Ok(())
}
