//! The bootstrap provider's `#cloud-config` against the real cloud-init (Debian's `cloud-init`
//! package, its own schema validator and the very function it uses to turn `runcmd` into the
//! shell script it runs): the document is valid, and the bootstrap-success sentinel is written
//! only when every command succeeded.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use metalboot::api::cloudinitconfig::{CloudInitConfigSpec, CloudInitFile};
use metalboot::controllers::cloudinitconfig::{SENTINEL, render};

fn spec(commands: &[&str]) -> CloudInitConfigSpec {
    CloudInitConfigSpec {
        files: vec![CloudInitFile {
            path: "/etc/metalboot/node.env".into(),
            content: Some("ROLE=worker\n".into()),
            permissions: Some("0600".into()),
            ..Default::default()
        }],
        commands: commands.iter().map(|c| c.to_string()).collect(),
        ..Default::default()
    }
}

#[test]
fn real_cloud_init_accepts_the_document() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("user-data");
    let doc = render(
        &spec(&["echo 'bootstrap: step 1'", "true"]),
        &BTreeMap::new(),
    )
    .expect("render");
    std::fs::write(&file, &doc).expect("write");
    let out = Command::new("cloud-init")
        .args(["schema", "--config-file"])
        .arg(&file)
        .output()
        .expect("cloud-init (Debian package cloud-init)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("Valid cloud-config"),
        "{text}\n{doc}"
    );
}

/// The script cloud-init would run for this document's runcmd, with the sentinel moved into
/// `dir` (a test does not write /run).
fn runcmd_script(commands: &[&str], sentinel: &std::path::Path) -> String {
    let doc = render(&spec(commands), &BTreeMap::new()).expect("render");
    let parsed: serde_yaml::Value =
        serde_yaml::from_str(doc.trim_start_matches("#cloud-config\n")).expect("YAML");
    let runcmd: Vec<String> = parsed["runcmd"]
        .as_sequence()
        .expect("runcmd")
        .iter()
        .map(|c| {
            c.as_str()
                .expect("string entries")
                .replace(
                    "/run/cluster-api",
                    &sentinel.parent().expect("dir").display().to_string(),
                )
                .replace(
                    SENTINEL.rsplit('/').next().expect("name"),
                    &sentinel.file_name().expect("name").to_string_lossy(),
                )
        })
        .collect();
    let mut child = Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import json, sys; from cloudinit import util; sys.stdout.write(util.shellify(json.load(sys.stdin)))",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("Debian's python3 with cloud-init");
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(serde_json::to_string(&runcmd).expect("json").as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("shellify");
    assert!(out.status.success());
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn the_sentinel_means_every_command_succeeded() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (commands, succeeds) in [
        (&["true", "echo ok"][..], true),
        (&["true", "false", "echo after the failure"][..], false),
        (&["exit 3"][..], false),
    ] {
        let sentinel = dir.path().join("run/bootstrap-success.complete");
        let _ = std::fs::remove_file(&sentinel);
        let script = runcmd_script(commands, &sentinel);
        let run = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .output()
            .expect("sh");
        assert_eq!(run.status.success(), succeeds, "{commands:?}\n{script}");
        assert_eq!(
            sentinel.exists(),
            succeeds,
            "sentinel after {commands:?}:\n{script}"
        );
    }
}
