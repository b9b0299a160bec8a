//! Image-write throughput: the deploy agent's `write_image` (digest checked while streaming,
//! gzip or qcow2 decoded, written in blocks) against the pipeline an operator would type for the
//! same job (`dd bs=4M conv=fsync`, `gzip -dc | dd`, `qemu-img convert -O raw -S 0`, with
//! `sha256sum` of the source alongside), on the lab's real OS image (`make os-image`,
//! target/lab/os). Same machine, same run, source in the page cache for both; the ratio is
//! printed. The qcow2 write is checked against the raw image's digest.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use metalboot::agent::image::{ImageSource, write_image};
use metalboot::api::metalmachine::{ChecksumType, ImageFormat};

fn sha256_of(sums: &str, name: &str) -> Option<String> {
    sums.lines()
        .find(|l| l.ends_with(&format!(" {name}")))
        .and_then(|l| l.split_whitespace().next())
        .map(String::from)
}

fn mib_per_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / took.as_secs_f64().max(1e-9)
}

fn main() {
    let project = Path::new(env!("CARGO_MANIFEST_DIR"));
    let os = project.join("target/lab/os");
    let Ok(sums) = std::fs::read_to_string(os.join("SHA256SUMS")) else {
        eprintln!("image bench: run `make os-image` first (target/lab/os is empty)");
        std::process::exit(1);
    };
    let work = project.join("target/bench-image");
    let _ = std::fs::create_dir_all(&work);
    let out = work.join("disk.out");
    println!(
        "image write: metalboot agent vs dd / gzip -dc | dd / qemu-img convert (+ sha256sum), one run each"
    );
    println!(
        "{:<6} {:>10} {:>14} {:>14} {:>7}",
        "format", "written", "agent MiB/s", "coreutils MiB/s", "ratio"
    );
    for (name, format) in [
        ("debian.raw", ImageFormat::Raw),
        ("debian.raw.gz", ImageFormat::Gzip),
        ("debian.qcow2", ImageFormat::Qcow2),
    ] {
        let source = os.join(name);
        let Some(checksum) = sha256_of(&sums, name) else {
            eprintln!("image bench: {name} is not in SHA256SUMS");
            std::process::exit(1);
        };
        // Both read the source from the page cache.
        let _ = Command::new("cat")
            .arg(&source)
            .stdout(std::process::Stdio::null())
            .status();

        let _ = std::fs::remove_file(&out);
        let started = Instant::now();
        let written = (|| -> Result<u64, String> {
            let reader =
                BufReader::with_capacity(1 << 20, File::open(&source).map_err(|e| e.to_string())?);
            let length = std::fs::metadata(&source).map(|m| m.len()).ok();
            let mut disk = File::create(&out).map_err(|e| e.to_string())?;
            let progress = write_image(
                ImageSource {
                    reader,
                    format,
                    checksum: checksum.clone(),
                    checksum_type: ChecksumType::Sha256,
                    length,
                },
                &mut disk,
                u64::MAX,
                |_| {},
            )
            .map_err(|e| e.to_string())?;
            disk.sync_all().map_err(|e| e.to_string())?;
            Ok(progress.written)
        })();
        let agent = started.elapsed();
        let written = match written {
            Ok(w) => w,
            Err(e) => {
                eprintln!("image bench: the agent failed on {name}: {e}");
                std::process::exit(1);
            }
        };

        // The qcow2 write must give the raw image back, byte for byte.
        if format == ImageFormat::Qcow2 {
            let got = Command::new("sha256sum")
                .arg(&out)
                .output()
                .ok()
                .and_then(|o| String::from_utf8(o.stdout).ok())
                .and_then(|o| o.split_whitespace().next().map(String::from));
            if got != sha256_of(&sums, "debian.raw") {
                eprintln!("image bench: the qcow2 write differs from debian.raw");
                std::process::exit(1);
            }
        }
        let _ = std::fs::remove_file(&out);
        let (src, dst) = (source.display(), out.display());
        let pipeline = match format {
            ImageFormat::Gzip => format!(
                "sha256sum {src} >/dev/null & gzip -dc {src} | dd of={dst} bs=4M iflag=fullblock conv=fsync status=none; wait"
            ),
            // -S 0: every byte written, zeros included, as the agent does on a disk.
            ImageFormat::Qcow2 => format!(
                "sha256sum {src} >/dev/null & qemu-img convert -q -f qcow2 -O raw -S 0 {src} {dst} && sync {dst}; wait"
            ),
            _ => format!(
                "sha256sum {src} >/dev/null & dd if={src} of={dst} bs=4M conv=fsync status=none; wait"
            ),
        };
        let started = Instant::now();
        let ok = Command::new("sh")
            .args(["-c", &pipeline])
            .status()
            .is_ok_and(|s| s.success());
        let reference = started.elapsed();
        if !ok {
            eprintln!("image bench: `{pipeline}` failed");
            std::process::exit(1);
        }
        let _ = std::fs::remove_file(&out);
        let (ours, theirs) = (mib_per_s(written, agent), mib_per_s(written, reference));
        println!(
            "{:<6} {:>9}M {:>14.1} {:>14.1} {:>6.2}x",
            match format {
                ImageFormat::Gzip => "gzip",
                ImageFormat::Qcow2 => "qcow2",
                _ => "raw",
            },
            written >> 20,
            ours,
            theirs,
            ours / theirs
        );
    }
}
