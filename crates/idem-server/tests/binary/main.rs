//! The `idem` binary as a user runs it: start-up errors, and a real server on a real socket.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn idem() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.env_remove("IDEM_STORE")
        .env_remove("IDEM_LISTEN")
        .env_remove("IDEM_API_KEYS_FILE")
        .env_remove("IDEM_UPSTREAM")
        .env_remove("IDEM_GATEWAY_CONFIG");
    cmd
}

fn fails_with(args: &[&str], expected: &str) {
    let out = idem().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(stderr.contains(expected), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
}

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Server {
    start_command("serve", args)
}

fn start_command(command: &str, args: &[&str]) -> Server {
    let mut cmd = idem();
    cmd.args([command, "--listen", "127.0.0.1:0"]).args(args);
    start_child(cmd)
}

/// Runs `cmd` (a server listening on port 0) and waits for the address it prints.
fn start_child(mut cmd: Command) -> Server {
    let mut child = cmd
        .env("IDEM_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let line = lines.next().expect("server printed its address").unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    // keep draining stderr so the server never blocks on a full pipe
    std::thread::spawn(move || for _ in lines {});
    Server { child, addr }
}

/// One HTTP/1.1 exchange on a fresh connection; returns (status, body).
fn http(addr: &str, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status, body)
}

fn post_json(addr: &str, path: &str, body: &str) -> (u16, String) {
    http(
        addr,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
}

/// A one-thread HTTP upstream that counts requests; the first one takes 800 ms.
fn counting_upstream() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let counter = counter.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    if line == "\r\n" {
                        break;
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                if n == 1 {
                    std::thread::sleep(Duration::from_millis(800));
                }
                let out = format!("{{\"run\":{n}}}");
                let _ = write!(
                    stream,
                    "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{out}",
                    out.len()
                );
            });
        }
    });
    (addr, runs)
}

fn order(addr: &str) -> (u16, String) {
    http(
        addr,
        "POST /orders HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer t\r\nIdempotency-Key: order-7\r\nContent-Length: 6\r\n\r\npay 10",
    )
}

/// Reads what the server sends until it closes the connection, writing `trickle` one byte at
/// a time first (a pause between bytes); `None` if it is still open after 30 s.
fn read_until_closed(s: &mut TcpStream, trickle: &[u8]) -> Option<String> {
    let started = std::time::Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut trickle = trickle.iter();
    let mut out = Vec::new();
    let mut buf = [0; 4096];
    while started.elapsed() < Duration::from_secs(30) {
        if let Some(b) = trickle.next()
            && s.write_all(&[*b]).is_err()
        {
            return Some(String::from_utf8_lossy(&out).into_owned());
        }
        match s.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&out).into_owned()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(String::from_utf8_lossy(&out).into_owned()),
        }
    }
    None
}

/// `n` connections that send nothing.
fn crowd(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect()
}

fn get(addr: &str, path: &str) -> (u16, String) {
    http(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    )
}

mod cli;
mod limits;
mod serving;
