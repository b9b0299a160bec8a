//! The Redfish driver against a real emulator (sushy-tools, fake driver) — directly, over HTTPS,
//! and behind a fault-injecting proxy that also adds Redfish sessions.

#[path = "support/faultproxy.rs"]
mod faultproxy;
#[path = "support/redfish_conformance.rs"]
mod redfish_conformance;
#[path = "support/sushy.rs"]
mod sushy;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use faultproxy::{Fault, FaultProxy};
use metalboot::bmc::redfish::{RedfishBmc, RedfishOptions};
use metalboot::bmc::{Bmc, BmcError, BootDevice, Credentials, PowerState, Unreachable};
use redfish_conformance::redfish_conformance;
use sushy::{Sushy, SushyConfig};

const USER: &str = "admin";
const PASSWORD: &str = "Pw-5ecret-do-NOT-log-77";

// ---- capture of everything the suite logs or prints about errors ------------------------------

#[derive(Clone)]
struct Buf(Arc<Mutex<Vec<u8>>>);
impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn captured() -> &'static Arc<Mutex<Vec<u8>>> {
    static BUF: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    BUF.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = Buf(buf.clone());
        let _ = tracing_subscriber::fmt()
            .with_env_filter("trace")
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .try_init();
        buf
    })
}

/// Record an error's Display and Debug in the capture and hand it back.
fn seen(e: BmcError) -> BmcError {
    let text = format!("ERROR Display: {e}\nERROR Debug: {e:?}\n");
    captured()
        .lock()
        .expect("log buffer")
        .extend_from_slice(text.as_bytes());
    e
}

fn creds() -> Credentials {
    Credentials::new(USER, PASSWORD)
}

fn opts() -> RedfishOptions {
    RedfishOptions {
        timeout: Duration::from_secs(10),
        backoff: Duration::from_millis(200),
        ..RedfishOptions::default()
    }
}

fn emulator(systems: u8) -> Sushy {
    captured();
    sushy::start(SushyConfig {
        systems: (1..=systems).map(sushy::system).collect(),
        tls: None,
        auth: Some((USER.into(), PASSWORD.into())),
    })
}

fn bmc(address: &str, creds: Credentials, options: RedfishOptions) -> RedfishBmc {
    RedfishBmc::new(address, creds, options).expect("client")
}

// ---- conformance ------------------------------------------------------------------------------

#[tokio::test]
async fn conformance_direct_with_basic_auth_and_no_system_path() {
    let emu = emulator(1);
    let report = redfish_conformance(&emu.address(""), creds(), opts())
        .await
        .unwrap_or_else(|e| panic!("conformance: {e}\nemulator log:\n{}", emu.log()));
    assert_eq!(report.initial_power, PowerState::Off);
    let inv = &report.inventory;
    assert_eq!(
        inv.system_uuid.as_deref(),
        Some(emu.systems[0].uuid.as_str())
    );
    assert_eq!(inv.manufacturer.as_deref(), Some("Sushy Emulator"));
    println!(
        "metalboot bmc probe (sushy-tools):\n{}",
        metalboot::bmc::cli::probe_text(&report.probe)
    );
    let macs: Vec<_> = inv.nics.iter().filter_map(|n| n.mac.clone()).collect();
    assert_eq!(macs, emu.systems[0].macs);
    // sushy-tools quirk: a `Once` override reads back as `Continuous`.
    assert_eq!(report.boot_enabled_read_back.as_deref(), Some("Continuous"));
}

#[tokio::test]
async fn conformance_with_sessions_and_session_is_deleted_on_logout() {
    let emu = emulator(2);
    let proxy = FaultProxy::start(&emu.base, true).await;
    let address = proxy.address(&emu.system_path(1));
    redfish_conformance(&address, creds(), opts())
        .await
        .unwrap_or_else(|e| panic!("conformance: {e}\nemulator log:\n{}", emu.log()));
    assert_eq!(
        proxy.count("POST", "/redfish/v1/SessionService/Sessions"),
        1,
        "{:?}",
        proxy.log()
    );
    assert_eq!(
        proxy.count("DELETE", "/redfish/v1/SessionService/Sessions/"),
        1
    );
    assert_eq!(proxy.session_count(), 0, "the session is gone after logout");

    // Observe through the SessionService: one session while logged in, none after drop.
    let b = bmc(&address, creds(), opts());
    b.power_state().await.expect("power state");
    assert!(b.has_session().await);
    assert_eq!(proxy.session_count(), 1);
    drop(b);
    let until = Instant::now() + Duration::from_secs(5);
    while proxy.session_count() != 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        proxy.session_count(),
        0,
        "dropping the client logs out (best effort)"
    );
}

#[tokio::test]
async fn power_on_is_applied_late_and_observed() {
    let emu = emulator(1);
    let b = bmc(&emu.address(&emu.system_path(0)), creds(), opts());
    assert_eq!(b.power_state().await.expect("state"), PowerState::Off);
    b.power_on().await.expect("power on");
    redfish_conformance::wait_power(&b, PowerState::On, Duration::from_secs(30))
        .await
        .expect("comes on");
    b.power_off_force().await.expect("force off");
    redfish_conformance::wait_power(&b, PowerState::Off, Duration::from_secs(30))
        .await
        .expect("goes off");
}

// ---- auth and addressing ----------------------------------------------------------------------

#[tokio::test]
async fn wrong_password_is_an_auth_error_with_basic_auth_and_with_sessions() {
    let emu = emulator(1);
    let wrong = Credentials::new(USER, "wrong-password");
    let e = seen(
        bmc(&emu.address(""), wrong.clone(), opts())
            .power_state()
            .await
            .expect_err("basic"),
    );
    assert!(matches!(e, BmcError::AuthFailed { .. }), "{e:?}");
    assert_eq!(e.reason(), "BmcAuthFailed");
    assert!(e.to_string().contains("admin"), "{e}");

    let proxy = FaultProxy::start(&emu.base, true).await;
    let e = seen(
        bmc(&proxy.address(""), wrong, opts())
            .inventory()
            .await
            .expect_err("session"),
    );
    assert!(matches!(e, BmcError::AuthFailed { .. }), "{e:?}");
}

#[tokio::test]
async fn unknown_system_path_lists_the_available_systems() {
    let emu = emulator(2);
    let e = seen(
        bmc(&emu.address("/redfish/v1/Systems/no-such"), creds(), opts())
            .power_state()
            .await
            .expect_err("not found"),
    );
    let BmcError::NotFound { available, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(available.len(), 2, "{e}");
    for i in 0..2 {
        assert!(e.to_string().contains(&emu.system_path(i)), "{e}");
    }
    assert_eq!(e.reason(), "BmcNotFound");

    // Two systems and no path: ambiguous, and the error says which exist.
    let e = seen(
        bmc(&emu.address(""), creds(), opts())
            .power_state()
            .await
            .expect_err("ambiguous"),
    );
    assert!(
        e.to_string().contains(&emu.system_path(0)) && e.to_string().contains(&emu.system_path(1)),
        "{e}"
    );

    // HTTPS to a plain-HTTP port: a TLS error with a hint, not a retried "unreachable".
    let e = seen(
        bmc(
            &format!("redfish://127.0.0.1:{}", emu.port),
            creds(),
            opts(),
        )
        .power_state()
        .await
        .expect_err("not TLS"),
    );
    assert!(matches!(e, BmcError::Tls { .. }), "{e:?}");
    assert!(e.to_string().contains("redfish+http://"), "{e}");

    // Nothing listening: connection refused, said so.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let e = seen(
        bmc(&format!("redfish+http://127.0.0.1:{port}"), creds(), opts())
            .power_state()
            .await
            .expect_err("refused"),
    );
    assert!(
        matches!(
            e,
            BmcError::Unreachable {
                cause: Unreachable::ConnectionRefused,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("connection refused"), "{e}");
}

#[tokio::test]
async fn https_needs_the_ca_unless_verification_is_disabled() {
    captured();
    let ca = metalboot::pki::Ca::new("bmc test CA").expect("ca");
    let cert = ca
        .issue_server(&["localhost"], &["127.0.0.1".parse().expect("ip")])
        .expect("server cert");
    let emu = sushy::start(SushyConfig {
        systems: vec![sushy::system(1)],
        tls: Some(cert),
        auth: Some((USER.into(), PASSWORD.into())),
    });
    let address = emu.address("");
    assert!(address.starts_with("redfish://"));

    let with_ca = RedfishOptions {
        ca_pem: Some(ca.cert_pem()),
        ..opts()
    };
    let inv = bmc(&address, creds(), with_ca)
        .inventory()
        .await
        .expect("HTTPS with the CA");
    assert_eq!(
        inv.system_uuid.as_deref(),
        Some(emu.systems[0].uuid.as_str())
    );

    let e = seen(
        bmc(&address, creds(), opts())
            .power_state()
            .await
            .expect_err("unknown CA"),
    );
    assert!(matches!(e, BmcError::Tls { .. }), "{e:?}");
    assert_eq!(e.reason(), "BmcTLSError");

    let insecure = RedfishOptions {
        disable_certificate_verification: true,
        ..opts()
    };
    assert_eq!(
        bmc(&address, creds(), insecure)
            .power_state()
            .await
            .expect("insecure"),
        PowerState::Off
    );
}

// ---- faults -----------------------------------------------------------------------------------

const SYS: &str = "/redfish/v1/Systems/";

#[tokio::test]
async fn transient_503_is_retried_and_persistent_503_gives_up_naming_it() {
    let emu = emulator(1);
    let proxy = FaultProxy::start(&emu.base, true).await;
    let b = bmc(&proxy.address(""), creds(), opts());
    proxy.inject(Some("GET"), SYS, Fault::Status(503), 2);
    assert_eq!(b.power_state().await.expect("retried"), PowerState::Off);

    proxy.inject(Some("GET"), SYS, Fault::Status(503), usize::MAX);
    let started = Instant::now();
    let e = seen(b.power_state().await.expect_err("persistent 503"));
    let took = started.elapsed();
    proxy.clear_faults();
    assert!(matches!(e, BmcError::Rejected { status: 503, .. }), "{e:?}");
    assert!(e.to_string().contains("503"), "{e}");
    assert!(
        e.to_string().contains("injected HTTP 503"),
        "carries the Redfish message: {e}"
    );
    assert!(
        took < Duration::from_secs(3),
        "bounded retries, took {took:?}"
    );
    assert!(e.is_transient());
}

#[tokio::test]
async fn reset_actions_are_not_retried_once_sent() {
    let emu = emulator(1);
    let proxy = FaultProxy::start(&emu.base, false).await;
    let b = bmc(&proxy.address(""), creds(), opts());
    b.power_state().await.expect("warm up");
    proxy.inject(Some("POST"), SYS, Fault::Status(503), usize::MAX);
    let e = seen(b.power_on().await.expect_err("503 on reset"));
    assert!(matches!(e, BmcError::Rejected { status: 503, .. }), "{e:?}");
    assert_eq!(
        proxy.count("POST", SYS),
        1,
        "exactly one reset POST: {:?}",
        proxy.log()
    );

    proxy.clear_faults();
    proxy.inject(Some("POST"), SYS, Fault::Drop, 1);
    let e = seen(b.power_on().await.expect_err("dropped reset"));
    assert!(
        matches!(
            e,
            BmcError::Unreachable {
                cause: Unreachable::ConnectionDropped,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        proxy.count("POST", SYS),
        2,
        "the dropped reset was not resent"
    );
}

#[tokio::test]
async fn dropped_connections_are_retried_then_reported() {
    let emu = emulator(1);
    let proxy = FaultProxy::start(&emu.base, false).await;
    let b = bmc(&proxy.address(""), creds(), opts());
    proxy.inject(Some("GET"), SYS, Fault::Drop, 1);
    assert_eq!(
        b.power_state().await.expect("retried after a drop"),
        PowerState::Off
    );
    proxy.inject(Some("GET"), SYS, Fault::Drop, usize::MAX);
    let e = seen(b.power_state().await.expect_err("always dropped"));
    assert!(
        matches!(
            e,
            BmcError::Unreachable {
                cause: Unreachable::ConnectionDropped,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("connection dropped"), "{e}");
    assert_eq!(e.reason(), "BmcUnreachable");
}

#[tokio::test]
async fn a_stalled_bmc_times_out_with_the_timeout_named() {
    let emu = emulator(1);
    let proxy = FaultProxy::start(&emu.base, false).await;
    let options = RedfishOptions {
        timeout: Duration::from_secs(2),
        ..opts()
    };
    let b = bmc(&proxy.address(""), creds(), options);
    b.power_state().await.expect("warm up");
    proxy.inject(Some("GET"), SYS, Fault::Stall(Duration::from_secs(10)), 1);
    let started = Instant::now();
    let e = seen(b.power_state().await.expect_err("stall"));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        matches!(e, BmcError::Unreachable { cause: Unreachable::TimedOut(d), .. } if d == Duration::from_secs(2)),
        "{e:?}"
    );
    assert!(e.to_string().contains("timed out after 2 s"), "{e}");
    assert_eq!(e.reason(), "BmcTimeout");
}

#[tokio::test]
async fn malformed_json_is_a_protocol_error() {
    let emu = emulator(1);
    let proxy = FaultProxy::start(&emu.base, false).await;
    let b = bmc(&proxy.address(""), creds(), opts());
    b.power_state().await.expect("warm up");
    proxy.inject(Some("GET"), SYS, Fault::MalformedJson, 1);
    let e = seen(b.power_state().await.expect_err("malformed"));
    assert!(matches!(e, BmcError::Protocol { .. }), "{e:?}");
    assert!(e.to_string().contains("malformed JSON"), "{e}");
    assert_eq!(e.reason(), "BmcProtocolError");
    assert_eq!(b.power_state().await.expect("recovers"), PowerState::Off);
}

#[tokio::test]
async fn an_expired_session_logs_in_again_once() {
    let emu = emulator(1);
    let proxy = FaultProxy::start(&emu.base, true).await;
    let b = bmc(&proxy.address(""), creds(), opts());
    b.inventory().await.expect("first");
    proxy.expire_sessions();
    b.set_boot_once(BootDevice::Pxe, None)
        .await
        .expect("after 401: login again and succeed");
    assert_eq!(
        proxy.count("POST", "/redfish/v1/SessionService/Sessions"),
        2,
        "{:?}",
        proxy.log()
    );
    assert!(proxy.log().iter().any(|e| e.status == 401));
    assert_eq!(
        b.boot_override().await.expect("read").device(),
        Some(BootDevice::Pxe)
    );
    b.logout().await.expect("logout");
    assert_eq!(proxy.session_count(), 0);
}

#[tokio::test]
async fn twenty_concurrent_operations_never_overlap_at_the_bmc() {
    let emu = emulator(1);
    let proxy = FaultProxy::start(&emu.base, true).await;
    let address = proxy.address("");
    let shared: Arc<dyn Bmc> = Arc::new(bmc(&address, creds(), opts()));
    let other: Arc<dyn Bmc> = Arc::new(bmc(&address, creds(), opts()));
    let mut tasks = Vec::new();
    for i in 0..20 {
        let b = if i % 4 == 0 {
            other.clone()
        } else {
            shared.clone()
        };
        tasks.push(tokio::spawn(async move {
            match i % 3 {
                0 => b.power_state().await.map(|_| ()),
                1 => b.inventory().await.map(|_| ()),
                _ => b.set_boot_once(BootDevice::Pxe, None).await,
            }
        }));
    }
    for t in tasks {
        t.await.expect("task").expect("operation");
    }
    assert!(proxy.log().len() >= 40, "requests: {}", proxy.log().len());
    assert_eq!(
        proxy.max_in_flight(),
        1,
        "at most one request in flight per BMC"
    );
}

#[tokio::test]
async fn virtual_media_insert_and_eject() {
    let emu = emulator(1);
    // A tiny loopback HTTP server the emulator downloads the "ISO" from.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let iso = format!("http://{}/boot.iso", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let body = vec![0u8; 2048];
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(&body).await;
        }
    });
    let b = bmc(&emu.address(""), creds(), opts());
    b.insert_media(&iso)
        .await
        .unwrap_or_else(|e| panic!("insert: {e}\n{}", emu.log()));
    b.eject_media().await.expect("eject");
}

// ---- the password never shows -----------------------------------------------------------------

#[tokio::test]
async fn the_password_appears_in_no_log_line_and_no_error() {
    let emu = emulator(1);
    let proxy = FaultProxy::start(&emu.base, true).await;
    // Exercise logins, re-logins, failures and logouts with the password in play.
    let b = bmc(&proxy.address(""), creds(), opts());
    b.inventory().await.expect("inventory");
    proxy.expire_sessions();
    b.power_state().await.expect("re-login");
    proxy.inject(None, SYS, Fault::Status(500), usize::MAX);
    let _ = seen(b.power_state().await.expect_err("500"));
    proxy.clear_faults();
    b.logout().await.expect("logout");
    let direct = bmc(&emu.address(""), creds(), opts());
    direct.power_state().await.expect("basic auth");
    let _ = seen(
        bmc(
            &emu.address(""),
            Credentials::new(USER, format!("{PASSWORD}-wrong")),
            opts(),
        )
        .power_state()
        .await
        .expect_err("wrong"),
    );
    let _ = seen(
        RedfishBmc::new(
            &format!("redfish://{USER}:{PASSWORD}@127.0.0.1/x"),
            creds(),
            opts(),
        )
        .expect_err("userinfo"),
    );
    let dbg = format!("{:?} {:?} {}", creds(), direct, creds().password);
    captured()
        .lock()
        .expect("buf")
        .extend_from_slice(dbg.as_bytes());

    let text = String::from_utf8_lossy(&captured().lock().expect("buf")).into_owned();
    // Shown with --nocapture: every error message the suite produced, for review.
    for line in text.lines().filter(|l| l.starts_with("ERROR Display")) {
        println!("{line}");
    }
    assert!(
        text.contains("redfish request"),
        "tracing output was captured"
    );
    assert!(text.contains("ERROR Display"), "errors were captured");
    use base64::Engine;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
    assert!(
        !text.contains(PASSWORD),
        "the password leaked into logs or errors"
    );
    assert!(!text.contains(&basic), "the basic-auth header leaked");
}
