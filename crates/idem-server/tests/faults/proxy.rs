//! A TCP proxy between one gateway and its store that the nemesis controls, as Toxiproxy does:
//! it passes bytes on, delays each chunk by a random time (so that the commands of a
//! gateway's pooled connections reach the store out of the order they were sent), holds
//! everything (a store that stops answering while the connections stay up), or cuts every
//! connection at once (a store's answer lost after it did the work). `tc netem` would do the
//! same at the packet level; these machines' kernel lacks it. Over TCP a lost packet is seen
//! by the application as a delay, and a lost connection as a cut: those are what it emulates.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the proxy does with the bytes it is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Pass,
    /// Each chunk waits up to this many milliseconds before it goes on.
    Jitter(u64),
    /// Nothing goes on until the mode changes; connections stay open.
    Hold,
}

struct Shared {
    mode: Mutex<Mode>,
    /// Bumped by [`Proxy::cut`]: every connection opened before it closes.
    generation: AtomicU64,
    seed: AtomicU64,
    /// Directions of connections closed by a cut so far (two per connection).
    severed: AtomicU64,
    /// Chunks held or delayed so far.
    slowed: AtomicU64,
}

pub(crate) struct Proxy {
    pub(crate) addr: String,
    shared: Arc<Shared>,
}

impl Proxy {
    /// A proxy on `ip` (a free port) to `target`.
    pub(crate) fn start(ip: &str, target: &str) -> Self {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Pass),
            generation: AtomicU64::new(0),
            seed: AtomicU64::new(0x2545_f491_4f6c_dd1d),
            severed: AtomicU64::new(0),
            slowed: AtomicU64::new(0),
        });
        let (s, target) = (shared.clone(), target.to_owned());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&target) else {
                    continue;
                };
                let generation = s.generation.load(Ordering::SeqCst);
                for (from, to) in [(&client, &server), (&server, &client)] {
                    let (from, to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
                    let s = s.clone();
                    std::thread::spawn(move || pump(from, to, &s, generation));
                }
            }
        });
        Self { addr, shared }
    }

    pub(crate) fn set(&self, mode: Mode) {
        *self.shared.mode.lock().unwrap() = mode;
    }

    /// Closes every open connection (new ones go through): how many it closed, counted by
    /// the connections themselves as they see the cut (within a read timeout).
    pub(crate) fn cut(&self) -> u64 {
        let before = self.shared.severed.load(Ordering::SeqCst);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(200));
        (self.shared.severed.load(Ordering::SeqCst) - before).div_ceil(2)
    }

    /// How many chunks were held or delayed so far: what a stall or jitter reached.
    pub(crate) fn slowed(&self) -> u64 {
        self.shared.slowed.load(Ordering::SeqCst)
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, s: &Shared, generation: u64) {
    let cut = || s.generation.load(Ordering::SeqCst) != generation;
    // Short reads, so that a cut is seen even on an idle connection.
    from.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut buf = vec![0; 16 * 1024];
    'pump: while !cut() {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(_) => break,
        };
        let mut slowed = false;
        loop {
            let mode = *s.mode.lock().unwrap();
            if mode != Mode::Pass && !slowed {
                slowed = true;
                s.slowed.fetch_add(1, Ordering::SeqCst);
            }
            match mode {
                Mode::Hold => std::thread::sleep(Duration::from_millis(20)),
                Mode::Jitter(most) => {
                    let draw = s.seed.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis((draw >> 33) % most.max(1)));
                    break;
                }
                Mode::Pass => break,
            }
            if cut() {
                break 'pump;
            }
        }
        if cut() || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    if cut() {
        s.severed.fetch_add(1, Ordering::SeqCst);
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
