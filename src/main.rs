use std::process::ExitCode;

#[cfg(all(feature = "jemalloc", not(target_env = "musl")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    metalboot::cli::run().await
}
