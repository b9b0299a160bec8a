//! `/artifacts` with curl over a real socket: whole files, ranges, HEAD, refusals, a large file —
//! from the Router alone (tower-http's `ServeDir`) and from the boot server's front, which sends
//! files with sendfile(2) and must answer exactly as the Router does. Then what the front does
//! when a client stops reading or a file shrinks under a transfer.

use std::io::Write;
use std::process::Command;

use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use metalboot::boot::artifacts::artifacts_router;
use metalboot::boot::front::FileRoutes;
use metalboot::boot::serve::{HttpLimits, serve_with_files};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn curl(args: &[&str]) -> (String, Vec<u8>, String) {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--path-as-is",
            "-D",
            "/dev/stderr",
            "-w",
            "\n%{http_code}",
        ])
        .args(args)
        .output()
        .expect("run curl");
    let split = out
        .stdout
        .iter()
        .rposition(|b| *b == b'\n')
        .expect("status line");
    (
        String::from_utf8_lossy(&out.stdout[split + 1..]).into_owned(),
        out.stdout[..split].to_vec(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn sha256(path: &std::path::Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

struct Served {
    root: tempfile::TempDir,
    dir: PathBuf,
    small: Vec<u8>,
    big: PathBuf,
}

/// An artifacts directory with a small file, a 50 MB one, and a link out of it.
fn artifacts() -> Served {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("artifacts");
    std::fs::create_dir_all(dir.join("debian")).expect("mkdir");
    std::fs::write(root.path().join("secret.txt"), "outside").expect("outside file");
    // A directory link out of the artifacts root (a mistake, or planted): must not be followed.
    std::os::unix::fs::symlink(root.path(), dir.join("up")).expect("dir symlink");
    let small: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(dir.join("vmlinuz"), &small).expect("vmlinuz");
    let big = dir.join("debian/initrd.img");
    {
        let mut f = std::fs::File::create(&big).expect("big");
        let chunk: Vec<u8> = (0..(1 << 20))
            .map(|i: u32| (i.wrapping_mul(2654435761) >> 24) as u8)
            .collect();
        for _ in 0..50 {
            f.write_all(&chunk).expect("write");
        }
    }
    Served {
        root,
        dir,
        small,
        big,
    }
}

fn app(dir: &Path) -> Router {
    Router::new()
        .route("/hello", get(|| async { "hello\n" }))
        .nest("/artifacts", artifacts_router(dir.to_path_buf()))
}

/// The boot server (budgets, front with sendfile) on loopback; returns its base URL.
async fn boot_server(dir: &Path, limits: HttpLimits) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let files = FileRoutes::default().route("/artifacts", dir, None);
    let app = app(dir);
    tokio::spawn(async move { serve_with_files(listener, app, limits, files).await });
    base
}

#[tokio::test]
async fn artifacts_are_served_with_ranges_and_nothing_outside_the_directory() {
    let served = artifacts();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let app = app(&served.dir);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let served = tokio::task::spawn_blocking(move || {
        curl_checks(&base, &served);
        served
    })
    .await
    .expect("curl checks through the Router");

    // The same checks through the front: the big file and the ranges go out with sendfile.
    let base = boot_server(&served.dir, HttpLimits::default()).await;
    let before = metalboot::metrics::sendfile_bytes();
    tokio::task::spawn_blocking(move || curl_checks(&base, &served))
        .await
        .expect("curl checks through the front");
    let sent = metalboot::metrics::sendfile_bytes() - before;
    println!("sent with sendfile: {sent} bytes");
    assert!(
        sent >= 50 << 20,
        "the 50 MB artifact went out with sendfile ({sent} bytes did)"
    );
}

fn curl_checks(base: &str, served: &Served) {
    let Served {
        root, small, big, ..
    } = served;
    let small = small.as_slice();
    {
        let (code, body, _) = curl(&[&format!("{base}/artifacts/vmlinuz")]);
        assert_eq!((code.as_str(), body.as_slice()), ("200", small));

        let (code, body, headers) = curl(&["-r", "0-99", &format!("{base}/artifacts/vmlinuz")]);
        assert_eq!(code, "206");
        assert_eq!(body, small[..100]);
        assert!(
            headers
                .to_lowercase()
                .contains("content-range: bytes 0-99/1000"),
            "{headers}"
        );

        let (code, body, _) = curl(&[
            "-H",
            "Range: bytes=-10",
            &format!("{base}/artifacts/vmlinuz"),
        ]);
        assert_eq!((code.as_str(), body.as_slice()), ("206", &small[990..]));

        let (code, _, _) = curl(&[
            "-H",
            "Range: bytes=5000-6000",
            &format!("{base}/artifacts/vmlinuz"),
        ]);
        assert_eq!(code, "416");

        let (code, body, headers) = curl(&["-I", &format!("{base}/artifacts/vmlinuz")]);
        assert_eq!(code, "200");
        assert!(
            headers.to_lowercase().contains("content-length: 1000"),
            "{headers}"
        );
        assert!(
            body.is_empty()
                || String::from_utf8_lossy(&body)
                    .to_lowercase()
                    .contains("content-length")
        );

        for escape in [
            "../secret.txt",
            "%2e%2e/secret.txt",
            "debian/../../secret.txt",
            "%2e%2e%2fsecret.txt",
            "..%5csecret.txt",
        ] {
            let (code, body, _) = curl(&[&format!("{base}/artifacts/{escape}")]);
            assert!(code.starts_with('4'), "{escape} → {code}");
            assert!(
                !String::from_utf8_lossy(&body).contains("outside"),
                "{escape} leaked the file"
            );
        }
        let (code, body, _) = curl(&[&format!("{base}/artifacts/up/secret.txt")]);
        assert_eq!(code, "403", "a directory link out of the root is refused");
        assert!(!String::from_utf8_lossy(&body).contains("outside"));
        let (code, _, _) = curl(&[&format!("{base}/artifacts/missing")]);
        assert_eq!(code, "404");

        let out = root.path().join("download");
        let (code, _, _) = curl(&[
            "-o",
            out.to_str().expect("path"),
            &format!("{base}/artifacts/debian/initrd.img"),
        ]);
        assert_eq!(code, "200");
        assert_eq!(sha256(&out), sha256(big), "50 MB artifact byte-identical");

        // One kept-alive connection for a route, files, a range and HEAD, in any order.
        let mut args = Vec::new();
        for (extra, path) in [
            (None, "hello"),
            (None, "artifacts/vmlinuz"),
            (None, "hello"),
            (Some("-r10-19"), "artifacts/vmlinuz"),
            (Some("-I"), "artifacts/vmlinuz"),
            (None, "artifacts/debian/initrd.img"),
        ] {
            if !args.is_empty() {
                args.push("--next".to_string());
            }
            args.extend(
                [
                    "-sS",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}:%{num_connects} ",
                ]
                .map(String::from),
            );
            args.extend(extra.map(String::from));
            args.push(format!("{base}/{path}"));
        }
        let out = Command::new("curl").args(&args).output().expect("curl");
        let seen = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(
            seen.trim(),
            "200:1 200:0 200:0 206:0 200:0 200:0",
            "six requests, one connection"
        );
    }
}

/// Polls `done` until it holds; panics after `limit`. Waits on what the server reports, not time.
async fn wait_for(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let started = tokio::time::Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "waited {limit:?} for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads until the server closes; returns the bytes read.
async fn until_closed(stream: &mut tokio::net::TcpStream) -> usize {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        match tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return total,
            Ok(Ok(n)) => total += n,
            Err(_) => panic!("the server kept the connection open"),
        }
    }
}

#[tokio::test]
async fn a_client_that_stops_reading_or_a_file_that_shrinks_ends_the_transfer_not_the_server() {
    let served = artifacts();
    let stall = Duration::from_secs(1);
    let limits = HttpLimits {
        request_timeout: stall,
        ..HttpLimits::default()
    };
    let base = boot_server(&served.dir, limits).await;
    let addr = base.trim_start_matches("http://").to_string();
    let size = std::fs::metadata(&served.big).expect("big").len() as usize;
    let request = b"GET /artifacts/debian/initrd.img HTTP/1.1\r\nHost: boot\r\n\r\n";

    // A client that takes nothing: the transfer is cut once it stalls for the budget.
    let stalled = metalboot::metrics::http_aborted("stalled");
    let mut idle = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    idle.write_all(request).await.expect("request");
    wait_for(
        "the stalled transfer to be cut",
        Duration::from_secs(30),
        || metalboot::metrics::http_aborted("stalled") > stalled,
    )
    .await;
    let read = until_closed(&mut idle).await;
    println!(
        "stall budget {stall:?}: a reader that took nothing got {read} of {size} bytes, then the close"
    );
    assert!(read < size, "the transfer was cut ({read} of {size} bytes)");

    // A file truncated mid-transfer: the connection ends short, nothing past the new end is sent.
    let shrinking = served.dir.join("shrinking.img");
    std::fs::copy(&served.big, &shrinking).expect("copy");
    // (A second server with the default stall budget, so the wait below is not a stall.)
    let patient = boot_server(&served.dir, HttpLimits::default()).await;
    let shrank = metalboot::metrics::http_aborted("file-shrank");
    let mut reader = tokio::net::TcpStream::connect(patient.trim_start_matches("http://"))
        .await
        .expect("connect");
    reader
        .write_all(b"GET /artifacts/shrinking.img HTTP/1.1\r\nHost: boot\r\n\r\n")
        .await
        .expect("request");
    reader.readable().await.expect("the response began");
    std::fs::File::options()
        .write(true)
        .open(&shrinking)
        .and_then(|f| f.set_len(1 << 20))
        .expect("truncate");
    let read = until_closed(&mut reader).await;
    println!("a 50 MB file cut to 1 MB mid-transfer: the client got {read} bytes, then the close");
    assert!(
        read < size,
        "the transfer ended short ({read} of {size} bytes)"
    );
    assert!(
        metalboot::metrics::http_aborted("file-shrank") > shrank,
        "the server saw the file shrink"
    );

    // The server still answers.
    let url = format!("{base}/hello");
    let hello = tokio::task::spawn_blocking(move || curl(&[&url]))
        .await
        .expect("curl");
    assert_eq!(
        (hello.0.as_str(), hello.1.as_slice()),
        ("200", &b"hello\n"[..])
    );
}
