//! The latency fault: a TCP proxy in the drill's process between the processes it owns and
//! Postgres or RabbitMQ, which delays every chunk it passes on and can cut every connection at
//! once (`tc netem` needs a kernel module this kind of machine does not have).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A proxy to one upstream address.
pub struct Proxy {
    addr: SocketAddr,
    delay_ms: Arc<AtomicU64>,
    cuts: watch::Sender<u64>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (cuts, _) = watch::channel(0u64);
        let accept = tokio::spawn(accept_loop(
            listener,
            upstream,
            delay_ms.clone(),
            cuts.clone(),
        ));
        Ok(Self {
            addr,
            delay_ms,
            cuts,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Delays every chunk passed on, both ways, by `delay` from now on.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    /// Closes every connection open now (new ones are accepted as before).
    pub fn cut_all(&self) {
        self.cuts.send_modify(|generation| *generation += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut_all();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: String,
    delay_ms: Arc<AtomicU64>,
    cuts: watch::Sender<u64>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let (upstream, delay_ms, cut) = (upstream.clone(), delay_ms.clone(), cuts.subscribe());
        tokio::spawn(async move {
            // A refused upstream closes the client's connection, as the server itself would.
            if let Ok(server) = TcpStream::connect(&upstream).await {
                relay(client, server, delay_ms, cut).await;
            }
        });
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    delay_ms: Arc<AtomicU64>,
    mut cut: watch::Receiver<u64>,
) {
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, delay_ms.clone());
    let down = pump(sr, cw, delay_ms);
    // Dropping both halves on a cut closes both sockets: each side sees its peer vanish.
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = cut.changed() => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_ms: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn passes_bytes_delays_them_and_cuts_connections() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let proxy = Proxy::start(echo_addr.to_string()).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");

        proxy.set_delay(Duration::from_millis(100));
        let started = std::time::Instant::now();
        c.write_all(b"slow").await.unwrap();
        c.read_exact(&mut got).await.unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "both ways delayed"
        );

        proxy.cut_all();
        let mut rest = Vec::new();
        let n = c.read_to_end(&mut rest).await.unwrap_or(0);
        assert_eq!(n, 0, "the cut connection ends");
    }
}
