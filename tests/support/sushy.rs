//! sushy-tools' Redfish emulator (fake driver: no VMs) on a free loopback port, over HTTP or HTTPS,
//! with HTTP basic auth from an htpasswd (bcrypt) file. Installed by `hack/sushy-tools.sh` into
//! `target/tools/sushy`; started per test and killed when the handle drops.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use metalboot::pki::CertAndKey;

#[derive(Clone, Debug)]
pub struct FakeSystem {
    pub uuid: String,
    pub name: String,
    pub macs: Vec<String>,
}

pub struct SushyConfig {
    pub systems: Vec<FakeSystem>,
    /// Serve HTTPS with this certificate.
    pub tls: Option<CertAndKey>,
    /// Require HTTP basic auth for this user.
    pub auth: Option<(String, String)>,
}

pub struct Sushy {
    pub port: u16,
    /// `http://127.0.0.1:<port>` or `https://…`.
    pub base: String,
    pub systems: Vec<FakeSystem>,
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Sushy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn project_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The emulator binary, installing it on first use (the script is a no-op when present).
pub fn emulator_bin() -> &'static Path {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let bin = BIN.get_or_init(|| {
        let venv = project_dir().join("target/tools/sushy");
        let out = Command::new(project_dir().join("hack/sushy-tools.sh"))
            .output()
            .map_err(|e| format!("running hack/sushy-tools.sh: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "hack/sushy-tools.sh failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(venv.join("bin/sushy-emulator"))
    });
    match bin {
        Ok(p) => p,
        Err(e) => panic!("sushy-tools is not available (run `make sushy`): {e}"),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

fn bcrypt_hash(password: &str) -> String {
    let python = emulator_bin().with_file_name("python");
    let out = Command::new(python)
        .args([
            "-c",
            "import bcrypt,sys; print(bcrypt.hashpw(sys.stdin.read().encode(), bcrypt.gensalt(rounds=4)).decode())",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().expect("stdin").write_all(password.as_bytes())?;
            c.wait_with_output()
        })
        .expect("bcrypt via the sushy venv");
    assert!(out.status.success(), "bcrypt hashing failed");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string()
}

pub fn system(n: u8) -> FakeSystem {
    FakeSystem {
        uuid: format!("27946b59-9e44-4fa7-8e91-f3527a1ef0{n:02x}"),
        name: format!("node-{n}"),
        macs: vec![
            format!("52:54:00:aa:00:{n:02x}"),
            format!("52:54:00:bb:00:{n:02x}"),
        ],
    }
}

pub fn start(cfg: SushyConfig) -> Sushy {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let py = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"));
    let systems: Vec<String> = cfg
        .systems
        .iter()
        .map(|s| {
            let nics: Vec<String> = s.macs.iter().map(|m| format!("{{'mac': {}}}", py(m))).collect();
            format!(
                "{{'uuid': {}, 'name': {}, 'power_state': 'Off', 'external_notifier': False, 'nics': [{}]}}",
                py(&s.uuid),
                py(&s.name),
                nics.join(", ")
            )
        })
        .collect();
    let mut conf = format!(
        "SUSHY_EMULATOR_FAKE_DRIVER = True\nSUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\nSUSHY_EMULATOR_LISTEN_PORT = {port}\nSUSHY_EMULATOR_STATE_DIR = {}\nSUSHY_EMULATOR_FAKE_SYSTEMS = [{}]\n",
        py(&dir.path().join("state").display().to_string()),
        systems.join(", ")
    );
    if let Some((user, password)) = &cfg.auth {
        let htpasswd = dir.path().join("htpasswd");
        std::fs::write(&htpasswd, format!("{user}:{}\n", bcrypt_hash(password))).expect("htpasswd");
        conf.push_str(&format!(
            "SUSHY_EMULATOR_AUTH_FILE = {}\n",
            py(&htpasswd.display().to_string())
        ));
    }
    let scheme = if let Some(tls) = &cfg.tls {
        let cert = dir.path().join("tls.crt");
        let key = dir.path().join("tls.key");
        std::fs::write(&cert, &tls.cert_pem).expect("cert");
        std::fs::write(&key, &tls.key_pem).expect("key");
        conf.push_str(&format!(
            "SUSHY_EMULATOR_SSL_CERT = {}\nSUSHY_EMULATOR_SSL_KEY = {}\n",
            py(&cert.display().to_string()),
            py(&key.display().to_string())
        ));
        "https"
    } else {
        "http"
    };
    std::fs::create_dir_all(dir.path().join("state")).expect("state dir");
    let conf_path = dir.path().join("emulator.conf");
    std::fs::write(&conf_path, conf).expect("config");
    let log = std::fs::File::create(dir.path().join("emulator.log")).expect("log");
    let mut cmd = Command::new(emulator_bin());
    cmd.arg("--config")
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
    // SAFETY: prctl is async-signal-safe; the emulator dies with this test process.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let child = cmd.spawn().expect("start sushy-emulator");
    let mut sushy = Sushy {
        port,
        base: format!("{scheme}://127.0.0.1:{port}"),
        systems: cfg.systems,
        child,
        dir,
    };
    sushy.wait_ready();
    sushy
}

impl Sushy {
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("sushy-emulator exited ({status}):\n{}", self.log());
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "sushy-emulator did not listen on {} within 30 s:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("emulator.log")).unwrap_or_default()
    }

    /// `redfish+http://127.0.0.1:<port>` (or `redfish://` for HTTPS) plus `path`.
    pub fn address(&self, path: &str) -> String {
        let scheme = if self.base.starts_with("https") {
            "redfish"
        } else {
            "redfish+http"
        };
        format!("{scheme}://127.0.0.1:{}{path}", self.port)
    }

    pub fn system_path(&self, i: usize) -> String {
        format!("/redfish/v1/Systems/{}", self.systems[i].uuid)
    }
}
