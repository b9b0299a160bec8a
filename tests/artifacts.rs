//! `/artifacts` with curl over a real socket: whole files, ranges, HEAD, refusals, a large file.

use std::io::Write;
use std::process::Command;

use axum::Router;
use metalboot::boot::artifacts::artifacts_router;

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

#[tokio::test]
async fn artifacts_are_served_with_ranges_and_nothing_outside_the_directory() {
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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let app = Router::new().nest("/artifacts", artifacts_router(dir.clone()));
    tokio::spawn(async move { axum::serve(listener, app).await });

    let base2 = base.clone();
    tokio::task::spawn_blocking(move || {
        let base = base2;
        let (code, body, _) = curl(&[&format!("{base}/artifacts/vmlinuz")]);
        assert_eq!((code.as_str(), body.as_slice()), ("200", small.as_slice()));

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
        assert_eq!(sha256(&out), sha256(&big), "50 MB artifact byte-identical");
    })
    .await
    .expect("curl checks");
}
