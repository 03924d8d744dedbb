//! The upstream: a payments ledger that counts one effect per key, the one with the highest
//! fence (`Idem-Fence`), and refuses a write with a lower fence than one it took. It answers
//! after a random delay on both sides of the write, so that faults land in every gap; at
//! `/big`, with an answer padded to [`BIG`] bytes.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How many bytes of padding the ledger's answers to `POST /big` carry: large answers, for
/// the nemesis's bursts (`burst` in main.rs).
pub(crate) const BIG: usize = 256 << 10;

/// What the ledger holds.
#[derive(Debug, Clone, Default)]
pub(crate) struct Entries {
    /// Per key, the fence of the effect that counts.
    pub(crate) counted: HashMap<String, u64>,
    /// Every write it took, in order: key and fence.
    pub(crate) accepted: Vec<(String, u64)>,
    /// Every write it refused for a lower fence.
    pub(crate) refused: Vec<(String, u64)>,
}

pub(crate) struct Ledger {
    /// Where it answers on loopback.
    pub(crate) addr: String,
    entries: Arc<Mutex<Entries>>,
    requests: Arc<AtomicU64>,
}

impl Ledger {
    pub(crate) fn start() -> Self {
        let mut ledger = Self {
            addr: String::new(),
            entries: Arc::default(),
            requests: Arc::default(),
        };
        ledger.addr = ledger.listen("127.0.0.1");
        ledger
    }

    /// Where the ledger answers on `ip` (a free port of its own there).
    pub(crate) fn listen(&self, ip: &str) -> String {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (entries, requests) = (self.entries.clone(), self.requests.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let entries = entries.clone();
                let n = requests.fetch_add(1, Ordering::Relaxed);
                std::thread::spawn(move || serve(stream, &entries, n));
            }
        });
        addr
    }

    pub(crate) fn entries(&self) -> Entries {
        self.entries.lock().unwrap().clone()
    }
}

fn serve(mut stream: std::net::TcpStream, entries: &Mutex<Entries>, n: u64) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let (mut length, mut key, mut fence) = (0, None, None);
    let mut big = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if big.is_none() {
            big = Some(line.starts_with("POST /big "));
        }
        let lower = line.to_ascii_lowercase();
        if let Some((name, value)) = lower.split_once(':') {
            let value = value.trim().to_owned();
            match name {
                "content-length" => length = value.parse().unwrap_or(0),
                "idempotency-key" => key = Some(value),
                "idem-fence" => fence = value.parse::<u64>().ok(),
                _ => {}
            }
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let pause = |salt: u64| Duration::from_millis((n.wrapping_mul(2_654_435_761) ^ salt) % 150);
    std::thread::sleep(pause(17));
    let (status, answer) = match (key, fence) {
        (Some(key), Some(fence)) => {
            let mut e = entries.lock().unwrap();
            if e.counted.get(&key).is_some_and(|&counted| fence < counted) {
                e.refused.push((key, fence));
                ("409 Conflict", format!("{{\"stale\":{fence}}}"))
            } else {
                e.counted.insert(key.clone(), fence);
                e.accepted.push((key.clone(), fence));
                let pad = if big == Some(true) {
                    format!("\"pad\":\"{}\",", "x".repeat(BIG))
                } else {
                    String::new()
                };
                (
                    "201 Created",
                    format!("{{\"key\":\"{key}\",{pad}\"fence\":{fence}}}"),
                )
            }
        }
        _ => (
            "400 Bad Request",
            "{\"missing\":\"key or fence\"}".to_owned(),
        ),
    };
    std::thread::sleep(pause(91));
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{answer}",
        answer.len()
    );
}
