//! `GET /artifacts/<path>`: kernels and initrds from a directory, streamed in chunks (never read
//! whole into memory) with Range, HEAD and conditional requests — tower-http's `ServeDir`, behind
//! our own path check so nothing outside the directory can be named.

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tower_http::services::ServeDir;

/// Why a requested artifact path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathRejection {
    #[error("empty path")]
    Empty,
    #[error("path has a `..`, `.` or empty segment")]
    Traversal,
    #[error("path has a NUL, backslash or control character")]
    BadCharacter,
    #[error("path is longer than 1024 bytes")]
    TooLong,
}

/// Checks a relative artifact path (already percent-decoded): plain segments only.
pub fn check_relative_path(path: &str) -> Result<(), PathRejection> {
    if path.is_empty() {
        return Err(PathRejection::Empty);
    }
    if path.len() > 1024 {
        return Err(PathRejection::TooLong);
    }
    if path
        .chars()
        .any(|c| c == '\0' || c == '\\' || c.is_control())
    {
        return Err(PathRejection::BadCharacter);
    }
    if path.starts_with('/')
        || path
            .split('/')
            .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return Err(PathRejection::Traversal);
    }
    Ok(())
}

pub(crate) fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

async fn guard(
    axum::extract::State(root): axum::extract::State<Arc<PathBuf>>,
    request: Request,
    next: Next,
) -> Response {
    let raw = request.uri().path().trim_start_matches('/');
    let verdict = percent_decode(raw)
        .ok_or(PathRejection::BadCharacter)
        .and_then(|p| check_relative_path(&p).map(|()| p));
    match verdict {
        // A directory link out of the root is refused, as TFTP refuses it; a missing file is
        // left to the file server's 404.
        Ok(path) => match super::tftp::inside_root(&root, &path) {
            Err(super::tftp::Refusal::OutsideRoot) => {
                tracing::warn!(route = "/artifacts", path = %raw.chars().take(120).collect::<String>(), "artifact path leaves the root through a link");
                (
                    StatusCode::FORBIDDEN,
                    "refused: not under the artifacts directory\n",
                )
                    .into_response()
            }
            _ => next.run(request).await,
        },
        Err(why) => {
            tracing::warn!(route = "/artifacts", path = %raw.chars().take(120).collect::<String>(), %why, "refused artifact path");
            (StatusCode::BAD_REQUEST, format!("refused: {why}\n")).into_response()
        }
    }
}

/// Read size per chunk: 256 KiB instead of tower-http's 64 KiB quarters the syscalls and wakeups
/// per transfer (hack/bench-boot.sh measures it); 500 concurrent transfers then hold ~128 MiB.
const CHUNK: usize = 256 * 1024;

/// The `/artifacts` routes for `dir` (mount with `Router::nest("/artifacts", …)`).
pub fn artifacts_router(dir: PathBuf) -> Router {
    // Canonical once, so "inside the root" compares real paths.
    let root = std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
    Router::new()
        .fallback_service(
            ServeDir::new(dir)
                .append_index_html_on_directories(false)
                .with_buf_chunk_size(CHUNK),
        )
        .layer(middleware::from_fn_with_state(Arc::new(root), guard))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_checks() {
        for ok in ["vmlinuz", "debian/12/initrd.gz", "a-b_c.1"] {
            assert_eq!(check_relative_path(ok), Ok(()), "{ok}");
        }
        let refused = [
            ("", PathRejection::Empty),
            ("../etc/passwd", PathRejection::Traversal),
            ("a/../../b", PathRejection::Traversal),
            ("/etc/passwd", PathRejection::Traversal),
            ("a//b", PathRejection::Traversal),
            ("./a", PathRejection::Traversal),
            ("a/..", PathRejection::Traversal),
            ("a\\..\\b", PathRejection::BadCharacter),
            ("a\0b", PathRejection::BadCharacter),
            ("a\nb", PathRejection::BadCharacter),
        ];
        for (path, why) in refused {
            assert_eq!(check_relative_path(path), Err(why), "{path:?}");
        }
        assert_eq!(
            check_relative_path(&"a".repeat(1025)),
            Err(PathRejection::TooLong)
        );
        assert_eq!(percent_decode("%2e%2e/x").as_deref(), Some("../x"));
        assert_eq!(percent_decode("%zz"), None);
    }
}
