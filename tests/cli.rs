//! Command-line behaviour that needs no cluster.

use std::process::Command;

fn metalboot() -> Command {
    Command::new(env!("CARGO_BIN_EXE_metalboot"))
}

#[test]
fn manager_without_a_reachable_cluster_fails_with_one_clear_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{port}', insecure-skip-tls-verify: true}}}}]\nusers: [{{name: u, user: {{token: x}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: u}}}}]\ncurrent-context: c\n"
        ),
    )
    .expect("write kubeconfig");
    let out = metalboot()
        .args(["--log-format", "text", "manager", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .expect("run metalboot");
    assert!(!out.status.success(), "manager must fail without a cluster");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "exactly one line, got: {stderr}");
    assert!(
        lines[0].contains(&format!("127.0.0.1:{port}")),
        "names the endpoint: {stderr}"
    );
    assert!(
        lines[0].contains(&kubeconfig.display().to_string()),
        "names the kubeconfig: {stderr}"
    );
}

#[test]
fn manager_with_no_configuration_at_all_says_so() {
    let home = tempfile::tempdir().expect("tempdir");
    let out = metalboot()
        .arg("manager")
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("HOME", home.path())
        .output()
        .expect("run metalboot");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no cluster configured"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}
