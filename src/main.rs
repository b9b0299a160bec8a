#![deny(clippy::unwrap_used, clippy::expect_used)]
use std::process::ExitCode;

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    metalboot::cli::run().await
}
