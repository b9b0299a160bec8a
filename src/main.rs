use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    metalboot::cli::run().await
}
