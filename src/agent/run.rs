//! The agent's conversation with the boot service: report the inspection, fetch the task, write
//! the image with progress reports, leave the seed, report the outcome. A failed or interrupted
//! write is wiped before it is reported, so a half-written disk never boots.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};

use super::image::{ImageError, ImageSource, write_image};
use super::protocol::{AgentTask, DeployReport, DeployState};
use super::seed::{Seed, write_seed};
use super::wipe::{WipeMode, wipe};
use super::{hints, inspect};

/// Where the agent talks to and what it looks at.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// `http://…/agent/<token>` (with or without the trailing slash).
    pub url: String,
    /// Root of `/proc` and `/sys` (a recorded tree in tests).
    pub sys_root: PathBuf,
    /// Where disks appear (`/dev`; a directory of files in tests).
    pub dev_dir: PathBuf,
    /// How long to keep retrying the boot service before giving up.
    pub patience: Duration,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Written { device: String, bytes: u64 },
    Cleaned,
    Failed { reason: String, message: String },
    Nothing(String),
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the boot service refused {what}: {status} {body}")]
    Refused {
        what: &'static str,
        status: u16,
        body: String,
    },
    #[error("the boot service could not be reached for {what} within {patience:?}: {error}")]
    Unreachable {
        what: &'static str,
        patience: Duration,
        error: String,
    },
}

/// The `metalboot.agent=<url>` argument of a kernel command line.
pub fn url_from_cmdline(cmdline: &str) -> Option<String> {
    cmdline
        .split_whitespace()
        .find_map(|arg| arg.strip_prefix("metalboot.agent="))
        .map(str::to_string)
}

struct Conversation {
    client: reqwest::Client,
    base: String,
    patience: Duration,
}

impl Conversation {
    /// Sends one request, retrying transport errors and 5xx for up to `patience`; a 4xx is final.
    async fn send(
        &self,
        what: &'static str,
        build: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, AgentError> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(250);
        loop {
            let error = match build(&self.client).send().await {
                Ok(r) if r.status().is_success() => return Ok(r),
                Ok(r) if r.status().is_client_error() => {
                    let status = r.status().as_u16();
                    let body = r.text().await.unwrap_or_default();
                    return Err(AgentError::Refused {
                        what,
                        status,
                        body: body.trim().chars().take(200).collect(),
                    });
                }
                Ok(r) => format!("HTTP {}", r.status()),
                Err(e) => e.to_string(),
            };
            if started.elapsed() >= self.patience {
                return Err(AgentError::Unreachable {
                    what,
                    patience: self.patience,
                    error,
                });
            }
            tracing::warn!(what, %error, "boot service request failed; retrying");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }

    async fn report(&self, report: &DeployReport) -> Result<(), AgentError> {
        let url = format!("{}/report", self.base);
        self.send("report", |c| c.post(&url).json(report))
            .await
            .map(|_| ())
    }
}

fn failed(reason: &str, message: impl Into<String>) -> DeployReport {
    DeployReport {
        state: DeployState::Failed,
        device: None,
        written_bytes: 0,
        total_bytes: None,
        bytes_per_second: 0,
        reason: Some(reason.to_string()),
        message: Some(message.into()),
        received_at: None,
    }
}

/// Runs the agent once.
pub async fn run(config: AgentConfig) -> Result<Outcome, AgentError> {
    let conversation = Conversation {
        client: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| AgentError::Unreachable {
                what: "a client",
                patience: Duration::ZERO,
                error: e.to_string(),
            })?,
        base: config.url.trim_end_matches('/').to_string(),
        patience: config.patience,
    };
    let inventory = inspect::inspect(&config.sys_root);
    tracing::info!(
        disks = inventory.disks.len(),
        nics = inventory.nics.len(),
        "inspected"
    );
    let url = format!("{}/inspection", conversation.base);
    conversation
        .send("the inspection", |c| c.post(&url).json(&inventory))
        .await?;
    let url = format!("{}/task", conversation.base);
    let task: AgentTask = conversation
        .send("the task", |c| c.get(&url))
        .await?
        .json()
        .await
        .map_err(|e| AgentError::Refused {
            what: "the task",
            status: 200,
            body: format!("unreadable task: {e}"),
        })?;
    let (image, root_device_hints, seed) = match task {
        AgentTask::Done { reason } => return Ok(Outcome::Nothing(reason)),
        AgentTask::Clean { mode } => {
            return clean(&conversation, &inventory.disks, &config.dev_dir, mode).await;
        }
        AgentTask::Deploy {
            image,
            root_device_hints,
            seed,
        } => (image, root_device_hints, seed),
    };

    // The image's request first: its length (raw) helps choose the disk.
    let response = match conversation.send("the image", |c| c.get(&image.url)).await {
        Ok(r) => r,
        Err(e) => {
            let report = failed("ImageUnreadable", e.to_string());
            conversation.report(&report).await?;
            return Ok(outcome_of(&report));
        }
    };
    let length = response.content_length();
    let raw_length = matches!(image.format, crate::api::metalmachine::ImageFormat::Raw)
        .then_some(length)
        .flatten();
    let disk =
        match hints::choose_root_device(&inventory.disks, root_device_hints.as_deref(), raw_length)
        {
            Ok(d) => d.clone(),
            Err(e) => {
                let report = failed("NoRootDevice", e.to_string());
                conversation.report(&report).await?;
                return Ok(outcome_of(&report));
            }
        };
    let path = config.dev_dir.join(&disk.name);
    let mut device = match OpenOptions::new().read(true).write(true).open(&path) {
        Ok(f) => f,
        Err(e) => {
            let report = failed(
                "DiskWriteFailed",
                format!("opening {}: {e}", path.display()),
            );
            conversation.report(&report).await?;
            return Ok(outcome_of(&report));
        }
    };
    tracing::info!(device = %disk.name, url = %image.url, "writing the image");

    let written = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let stream = Box::pin(resuming_body(
        conversation.client.clone(),
        image.url.clone(),
        response,
        length,
    ));
    let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
    let counter = written.clone();
    let checksum = image.checksum.clone();
    let (format, checksum_type) = (image.format, image.checksum_type);
    let disk_size = u64::try_from(disk.size_bytes).unwrap_or(0);
    let mut writer_device = device.try_clone().map_err(|e| AgentError::Refused {
        what: "the disk",
        status: 0,
        body: e.to_string(),
    })?;
    let mut writing = tokio::task::spawn_blocking(move || {
        writer_device
            .seek(SeekFrom::Start(0))
            .map_err(ImageError::Disk)?;
        write_image(
            ImageSource {
                reader,
                format,
                checksum,
                checksum_type,
                length,
            },
            &mut writer_device,
            disk_size,
            |p| counter.store(p.written, Ordering::Relaxed),
        )
    });
    let result = loop {
        tokio::select! {
            done = &mut writing => break done,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {
                let bytes = written.load(Ordering::Relaxed);
                let secs = started.elapsed().as_secs().max(1);
                let progress = DeployReport {
                    state: DeployState::Writing,
                    device: Some(disk.name.clone()),
                    written_bytes: bytes,
                    total_bytes: raw_length,
                    bytes_per_second: bytes / secs,
                    reason: None,
                    message: None,
                    received_at: None,
                };
                // Progress is best effort: the write goes on if a report is lost.
                if let Err(e) = conversation.report(&progress).await {
                    tracing::warn!(error = %e, "progress report not delivered");
                }
            }
        }
    };
    let result = match result {
        Ok(r) => r,
        Err(e) => Err(ImageError::Disk(std::io::Error::other(e.to_string()))),
    };
    let report = match result {
        Ok(progress) => {
            let seed = Seed {
                instance_id: seed.instance_id,
                hostname: seed.hostname,
                seedfrom: seed.seedfrom,
            };
            match write_seed(&mut device, &seed) {
                Ok(_) => DeployReport {
                    state: DeployState::Written,
                    device: Some(disk.name.clone()),
                    written_bytes: progress.written,
                    total_bytes: Some(progress.written),
                    bytes_per_second: progress.written / started.elapsed().as_secs().max(1),
                    reason: None,
                    message: None,
                    received_at: None,
                },
                Err(e) => {
                    wipe_quietly(&mut device);
                    failed("SeedFailed", e.to_string())
                }
            }
        }
        Err(e) => {
            wipe_quietly(&mut device);
            failed(e.reason(), e.to_string())
        }
    };
    tracing::info!(state = ?report.state, reason = ?report.reason, "deployment ended");
    conversation.report(&report).await?;
    Ok(outcome_of(&report))
}

/// Wipes every disk the inspection found, reporting that it is still at work every few seconds
/// (a full erase takes long) and then `Cleaned`, or `Failed` with `CleaningFailed` naming the
/// disks it could not wipe.
async fn clean(
    conversation: &Conversation,
    disks: &[crate::api::metalhost::DiskInfo],
    dev_dir: &std::path::Path,
    mode: WipeMode,
) -> Result<Outcome, AgentError> {
    let paths: Vec<(String, PathBuf)> = disks
        .iter()
        .map(|d| (d.name.clone(), dev_dir.join(&d.name)))
        .collect();
    tracing::info!(disks = paths.len(), ?mode, "cleaning");
    let wiped = Arc::new(AtomicU64::new(0));
    let counter = wiped.clone();
    let mut wiping = tokio::task::spawn_blocking(move || {
        let mut failures = Vec::new();
        let mut names = Vec::new();
        for (name, path) in paths {
            let result = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .and_then(|mut disk| wipe(&mut disk, mode));
            match result {
                Ok(w) => {
                    counter.fetch_add(w.bytes, Ordering::Relaxed);
                    names.push(name);
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        }
        (names, failures)
    });
    let started = Instant::now();
    let outcome = loop {
        tokio::select! {
            done = &mut wiping => break done,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {
                let bytes = wiped.load(Ordering::Relaxed);
                let progress = DeployReport {
                    state: DeployState::Writing,
                    device: None,
                    written_bytes: bytes,
                    total_bytes: None,
                    bytes_per_second: bytes / started.elapsed().as_secs().max(1),
                    reason: None,
                    message: Some("cleaning".into()),
                    received_at: None,
                };
                if let Err(e) = conversation.report(&progress).await {
                    tracing::warn!(error = %e, "progress report not delivered");
                }
            }
        }
    };
    let report = match outcome {
        Ok((names, failures)) if failures.is_empty() => DeployReport {
            state: DeployState::Cleaned,
            device: None,
            written_bytes: wiped.load(Ordering::Relaxed),
            total_bytes: None,
            bytes_per_second: 0,
            reason: None,
            message: Some(if names.is_empty() {
                "no disks to wipe".to_string()
            } else {
                format!("wiped {} ({mode:?})", names.join(", "))
            }),
            received_at: None,
        },
        Ok((_, failures)) => failed("CleaningFailed", failures.join("; ")),
        Err(e) => failed("CleaningFailed", e.to_string()),
    };
    tracing::info!(state = ?report.state, message = ?report.message, "cleaning ended");
    conversation.report(&report).await?;
    Ok(match report.state {
        DeployState::Cleaned => Outcome::Cleaned,
        _ => outcome_of(&report),
    })
}

fn wipe_quietly(device: &mut File) {
    if let Err(e) = wipe(device, WipeMode::Metadata) {
        tracing::error!(error = %e, "wiping the partly written disk failed");
    }
}

fn outcome_of(report: &DeployReport) -> Outcome {
    match report.state {
        DeployState::Written => Outcome::Written {
            device: report.device.clone().unwrap_or_default(),
            bytes: report.written_bytes,
        },
        _ => Outcome::Failed {
            reason: report.reason.clone().unwrap_or_default(),
            message: report.message.clone().unwrap_or_default(),
        },
    }
}

/// How many times a broken image download is resumed before the write fails.
pub const IMAGE_RESUMES: u32 = 5;

/// The image's bytes, resumed with a `Range` request from where they stopped when the connection
/// breaks or ends before `Content-Length` (the boot service caps a connection's lifetime; links
/// drop), at most `IMAGE_RESUMES` times. Digest and decompression run over the joined bytes, so
/// a resume is invisible to them; a server that does not answer 206 from that offset fails it.
fn resuming_body(
    client: reqwest::Client,
    url: String,
    first: reqwest::Response,
    length: Option<u64>,
) -> impl Stream<Item = std::io::Result<axum::body::Bytes>> + Send + 'static {
    type Body = std::pin::Pin<Box<dyn Stream<Item = reqwest::Result<axum::body::Bytes>> + Send>>;
    struct Download {
        client: reqwest::Client,
        url: String,
        body: Option<Body>,
        offset: u64,
        resumes: u32,
    }
    let start = Download {
        client,
        url,
        body: Some(Box::pin(first.bytes_stream())),
        offset: 0,
        resumes: 0,
    };
    futures::stream::unfold(start, move |mut d| async move {
        let mut cause = match d.body.as_mut()?.next().await {
            Some(Ok(chunk)) => {
                d.offset += chunk.len() as u64;
                return Some((Ok(chunk), d));
            }
            None if length.is_none_or(|l| d.offset >= l) => return None,
            None => format!("the download ended at byte {} of {length:?}", d.offset),
            Some(Err(e)) => format!("the download broke at byte {}: {e}", d.offset),
        };
        while d.resumes < IMAGE_RESUMES {
            d.resumes += 1;
            tokio::time::sleep(Duration::from_secs(u64::from(d.resumes))).await;
            tracing::warn!(offset = d.offset, resume = d.resumes, cause = %cause, "resuming the image download");
            let range = format!("bytes={}-", d.offset);
            match d
                .client
                .get(&d.url)
                .header(reqwest::header::RANGE, range)
                .send()
                .await
            {
                Ok(r)
                    if r.status() == reqwest::StatusCode::PARTIAL_CONTENT
                        && content_range_start(&r) == Some(d.offset) =>
                {
                    d.body = Some(Box::pin(r.bytes_stream()));
                    // The next chunk comes from the resumed body.
                    return match d.body.as_mut()?.next().await {
                        Some(Ok(chunk)) => {
                            d.offset += chunk.len() as u64;
                            Some((Ok(chunk), d))
                        }
                        other => {
                            let why = match other {
                                Some(Err(e)) => e.to_string(),
                                _ => "no bytes after a resume".to_string(),
                            };
                            d.body = None;
                            Some((Err(std::io::Error::other(why)), d))
                        }
                    };
                }
                Ok(r) => {
                    cause = format!("resuming at byte {} was answered {}", d.offset, r.status())
                }
                Err(e) => cause = format!("resuming at byte {}: {e}", d.offset),
            }
        }
        d.body = None;
        Some((
            Err(std::io::Error::other(format!(
                "{cause} (gave up after {IMAGE_RESUMES} resumes)"
            ))),
            d,
        ))
    })
}

/// The first byte a 206 answer carries (`Content-Range: bytes <first>-<last>/<total>`).
fn content_range_start(response: &reqwest::Response) -> Option<u64> {
    let value = response
        .headers()
        .get(reqwest::header::CONTENT_RANGE)?
        .to_str()
        .ok()?;
    value
        .strip_prefix("bytes ")?
        .split('-')
        .next()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_url_comes_from_the_kernel_command_line() {
        assert_eq!(
            url_from_cmdline("console=ttyS0 metalboot.agent=http://10.0.2.2:8080/agent/abc quiet"),
            Some("http://10.0.2.2:8080/agent/abc".into())
        );
        assert_eq!(url_from_cmdline("console=ttyS0"), None);
    }
}
