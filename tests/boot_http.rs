//! The boot service's HTTP routes against a real apiserver: every route through the router
//! without a socket, then the same chain with curl over a real socket.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};
use metalboot::api::MetalHost;
use metalboot::api::metalhost::HostState;
use metalboot::api::metalmachine::BootProfile;
use metalboot::boot::http::{BootState, router};
use metalboot::boot::tokens;
use support::boot::*;
use tower::ServiceExt;

const BASE: &str = "http://10.0.2.2:8080";
const PROVISIONING_MAC: &str = "52:54:00:10:00:01";
const IDLE_MAC: &str = "52:54:00:10:00:02";

/// Binary-ish bootstrap data: NUL, high bytes, CRLF, no trailing newline.
fn user_data() -> Vec<u8> {
    let mut data = b"#cloud-config\r\nwrite_files: []\r\n".to_vec();
    data.extend([0u8, 0xff, 0xfe, b'\n', 0x80]);
    data.extend((0u8..=255).collect::<Vec<_>>());
    data
}

async fn get(state: &Arc<BootState>, path: &str, from: Option<&str>) -> (StatusCode, Vec<u8>) {
    request(
        state,
        Request::get(path).body(Body::empty()).expect("request"),
        from,
    )
    .await
}

async fn request(
    state: &Arc<BootState>,
    mut req: Request<Body>,
    from: Option<&str>,
) -> (StatusCode, Vec<u8>) {
    if let Some(ip) = from {
        let addr: SocketAddr = format!("{ip}:40000").parse().expect("addr");
        req.extensions_mut().insert(ConnectInfo(addr));
    }
    let response = router(state.clone()).oneshot(req).await.expect("router");
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 1 << 24)
        .await
        .expect("body");
    (status, body.to_vec())
}

fn text(body: &[u8]) -> String {
    String::from_utf8_lossy(body).into_owned()
}

async fn events_for(client: &kube::Client, ns: &str, name: &str) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect()
}

struct Fixture {
    ns: support::TestNamespace,
    record: tokens::BootRecord,
}

async fn fixture(prefix: &str) -> Fixture {
    let ns = support::namespace(prefix).await;
    install_crds(&ns.client).await;
    let client = &ns.client;
    create_host(client, &ns.name, "host-0", PROVISIONING_MAC).await;
    create_host(client, &ns.name, "host-1", IDLE_MAC).await;
    let machine = create_machine(
        client,
        &ns.name,
        "m1",
        BootProfile {
            kernel: "vmlinuz".into(),
            initrds: vec!["initrd.gz".into()],
            cmdline: Some("console=ttyS0".into()),
        },
    )
    .await;
    set_host_state(
        client,
        &ns.name,
        "host-0",
        HostState::Provisioning,
        Some(&machine),
    )
    .await;
    set_host_state(client, &ns.name, "host-1", HostState::Available, None).await;
    let record = create_boot_secret(client, &ns.name, &machine, "host-0", &user_data()).await;
    Fixture { ns, record }
}

#[tokio::test]
async fn every_route_through_the_router() {
    let Fixture { ns, record } = fixture("boot-router").await;
    let (state, mut callbacks) = boot_state(&ns.client, &ns.name, BASE, false).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1 && s.hosts.state().len() == 2
    })
    .await;
    let token = record.token.expose().to_string();

    // Hosts by state, counted from the store: the fixture has one provisioning, one available.
    let (status, body) = get(&state, "/metrics", None).await;
    assert_eq!(status, StatusCode::OK);
    let metrics = text(&body);
    for line in [
        r#"metalboot_hosts{state="Provisioning"} 1"#,
        r#"metalboot_hosts{state="Available"} 1"#,
        r#"metalboot_hosts{state="Error"} 0"#,
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
    }

    let (status, body) = get(&state, "/boot.ipxe", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        text(&body).contains("chain --autofree http://10.0.2.2:8080/ipxe/${mac:hexhyp}"),
        "{}",
        text(&body)
    );

    let (status, body) = get(&state, "/ipxe/52-54-00-10-00-01", None).await;
    assert_eq!(status, StatusCode::OK);
    let script = text(&body);
    assert!(script.contains(&format!(
        "kernel http://10.0.2.2:8080/artifacts/vmlinuz initrd=initrd0 console=ttyS0 ds=nocloud-net;s=http://10.0.2.2:8080/nocloud/{token}/"
    )), "{script}");
    assert!(
        script.contains("initrd --name initrd0 http://10.0.2.2:8080/artifacts/initrd.gz"),
        "{script}"
    );

    let (_, body) = get(&state, "/ipxe/52-54-00-10-00-02", None).await;
    let idle = text(&body);
    assert!(
        idle.contains("host-1 is Available") && !idle.contains("kernel"),
        "{idle}"
    );

    let (_, body) = get(&state, "/ipxe/52-54-00-99-99-99", None).await;
    let unknown = text(&body);
    assert!(
        unknown.contains("no MetalHost has boot MAC 52:54:00:99:99:99")
            && unknown.contains("?attempt=2"),
        "{unknown}"
    );
    let (_, body) = get(&state, "/ipxe/52-54-00-99-99-99?attempt=3", None).await;
    assert!(!text(&body).contains("chain"), "{}", text(&body));
    let (status, _) = get(&state, "/ipxe/not-a-mac", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, body) = get(&state, &format!("/nocloud/{token}/meta-data"), None).await;
    assert_eq!(status, StatusCode::OK);
    let meta: serde_yaml::Value = serde_yaml::from_slice(&body).expect("meta-data is YAML");
    assert_eq!(meta["local-hostname"], "host-0");
    assert_eq!(
        meta["provider-id"],
        format!("metalboot://{}/host-0", ns.name).as_str()
    );
    assert!(
        meta["instance-id"]
            .as_str()
            .is_some_and(|id| id.ends_with("-1"))
    );

    let (status, body) = get(&state, &format!("/nocloud/{token}/user-data"), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body,
        user_data(),
        "user-data must be the bootstrap data byte for byte"
    );

    let (_, body) = get(&state, &format!("/nocloud/{token}/vendor-data"), None).await;
    let vendor = text(&body);
    assert!(
        vendor.contains(&format!("url='http://10.0.2.2:8080/callback/{token}'")),
        "{vendor}"
    );
    assert!(
        vendor.contains("/run/cluster-api/bootstrap-success.complete"),
        "{vendor}"
    );
    let (_, body) = get(&state, &format!("/nocloud/{token}/network-config"), None).await;
    assert!(text(&body).starts_with("version: 2"));
    let (status, _) = get(&state, &format!("/nocloud/{token}/secrets"), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let wrong = tokens::Token::mint();
    for path in [
        format!("/nocloud/{}/user-data", wrong.expose()),
        "/nocloud/short/user-data".to_string(),
        format!("/nocloud/{}/user-data", "Z".repeat(64)),
    ] {
        let (status, body) = get(&state, &path, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert!(
            !body
                .windows(8)
                .any(|w| user_data().windows(8).any(|u| u == w)),
            "no bootstrap data leaks"
        );
    }

    let bad = Request::post(format!("/callback/{token}"))
        .body(Body::from("{\"addresses\":[\"not-an-ip\"]}"))
        .expect("req");
    let (status, body) = request(&state, bad, Some("10.0.2.15")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{}", text(&body));

    let good = Request::post(format!("/callback/{token}"))
        .header("content-type", "application/json")
        .body(Body::from(
            r#"{"hostname":"host-0","addresses":["10.0.2.15","fec0::15"]}"#,
        ))
        .expect("req");
    let (status, body) = request(&state, good, Some("10.0.2.15")).await;
    assert_eq!(status, StatusCode::OK, "{}", text(&body));
    let notice = tokio::time::timeout(std::time::Duration::from_secs(5), callbacks.recv())
        .await
        .expect("notice in time")
        .expect("notice");
    assert_eq!(
        (notice.namespace.as_str(), notice.metal_machine.as_str()),
        (ns.name.as_str(), "m1")
    );
    let secret = Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .get("m1-boot")
        .await
        .expect("boot Secret");
    let recorded = tokens::parse_secret(&secret)
        .expect("parse")
        .callback
        .expect("callback recorded");
    assert_eq!(recorded.hostname.as_deref(), Some("host-0"));
    assert_eq!(recorded.addresses.len(), 2);
    assert_eq!(recorded.source_ip, Some("10.0.2.15".parse().expect("ip")));

    // After the callback the token is dead: 404 and an Event naming the replay.
    until_stores("callback in the store", &state, |s| {
        s.boot_secrets
            .state()
            .iter()
            .any(|s| tokens::parse_boot_secret(s).is_ok_and(|r| r.callback.is_some()))
    })
    .await;
    let (status, _) = get(
        &state,
        &format!("/nocloud/{token}/user-data"),
        Some("10.0.2.99"),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let replay = Request::post(format!("/callback/{token}"))
        .body(Body::from("{}"))
        .expect("req");
    assert_eq!(request(&state, replay, None).await.0, StatusCode::NOT_FOUND);
    let (_, body) = get(&state, "/ipxe/52-54-00-10-00-01", None).await;
    assert!(
        text(&body).contains("already bootstrapped"),
        "{}",
        text(&body)
    );
    let events = support::eventually("replay Event", 20, || async {
        let events = events_for(&ns.client, &ns.name, "m1").await;
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("BootTokenReplayed"))
            .then_some(events)
    })
    .await;
    let note = events
        .iter()
        .find(|e| e.reason.as_deref() == Some("BootTokenReplayed"))
        .and_then(|e| e.note.clone())
        .unwrap_or_default();
    assert!(
        !note.contains(&token),
        "Events never carry the token: {note}"
    );
    assert!(note.contains("10.0.2.99"), "{note}");
}

#[tokio::test]
async fn pinned_source_address_refuses_a_second_host() {
    let Fixture { ns, record } = fixture("boot-pin").await;
    let (state, _rx) = boot_state(&ns.client, &ns.name, BASE, true).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1
    })
    .await;
    let token = record.token.expose();
    let (status, _) = get(&state, "/ipxe/52-54-00-10-00-01", Some("10.0.2.15")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = get(
        &state,
        &format!("/nocloud/{token}/user-data"),
        Some("10.0.2.15"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = get(
        &state,
        &format!("/nocloud/{token}/user-data"),
        Some("10.0.2.66"),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let spoofed = Request::post(format!("/callback/{token}"))
        .body(Body::from("{}"))
        .expect("req");
    assert_eq!(
        request(&state, spoofed, Some("10.0.2.66")).await.0,
        StatusCode::FORBIDDEN
    );
    support::eventually("mismatch Event", 20, || async {
        events_for(&ns.client, &ns.name, "m1")
            .await
            .iter()
            .any(|e| e.reason.as_deref() == Some("BootTokenSourceMismatch"))
            .then_some(())
    })
    .await;
}

/// A boot MAC that two MetalHosts name (a copied manifest) boots neither: no script, no token,
/// whichever host the request is really from. Once one of them lets the MAC go, the other's
/// script is served again. The lookup is the hosts' index, kept by a real watch.
#[tokio::test]
async fn a_boot_mac_two_hosts_name_boots_neither_until_one_lets_it_go() {
    let Fixture { ns, .. } = fixture("boot-shared-mac").await;
    let (state, _rx) = boot_state(&ns.client, &ns.name, BASE, false).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1 && s.hosts.state().len() == 2
    })
    .await;
    let (_, body) = get(&state, "/ipxe/52-54-00-10-00-01", None).await;
    assert!(text(&body).contains("kernel "), "{}", text(&body));

    // The copy writes the MAC in capitals: still the same NIC.
    create_host(
        &ns.client,
        &ns.name,
        "host-2",
        &PROVISIONING_MAC.to_uppercase(),
    )
    .await;
    until_stores("the copy in the stores", &state, |s| {
        s.hosts.state().len() == 3
    })
    .await;
    let (status, body) = get(&state, "/ipxe/52-54-00-10-00-01", None).await;
    let shared = text(&body);
    assert_eq!(status, StatusCode::OK);
    assert!(
        shared.contains(&format!(
            "boot MAC 52:54:00:10:00:01: MetalHosts {0}/host-0, {0}/host-2 all have this boot MAC",
            ns.name
        )) && !shared.contains("kernel")
            && !shared.contains("nocloud")
            && shared.trim_end().ends_with("exit"),
        "{shared}"
    );
    let (_, body) = get(&state, "/ipxe/52-54-00-10-00-02", None).await;
    assert!(
        text(&body).contains("host-1 is Available"),
        "another MAC is not affected: {}",
        text(&body)
    );

    Api::<MetalHost>::namespaced(ns.client.clone(), &ns.name)
        .delete("host-2", &Default::default())
        .await
        .expect("delete the copy");
    until_stores("the copy gone from the stores", &state, |s| {
        s.hosts.state().len() == 2
    })
    .await;
    let (_, body) = get(&state, "/ipxe/52-54-00-10-00-01", None).await;
    assert!(
        text(&body).contains("kernel "),
        "host-0 boots again: {}",
        text(&body)
    );
}

fn curl(args: &[&str]) -> (String, Vec<u8>) {
    let out = std::process::Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "curl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let split = out
        .stdout
        .iter()
        .rposition(|b| *b == b'\n')
        .expect("status line");
    (
        String::from_utf8_lossy(&out.stdout[split + 1..]).into_owned(),
        out.stdout[..split].to_vec(),
    )
}

#[tokio::test]
async fn the_chain_with_curl_over_a_socket() {
    let Fixture { ns, record } = fixture("boot-curl").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let base = format!("http://{addr}");
    let (state, _rx) = boot_state(&ns.client, &ns.name, &base, false).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1
    })
    .await;
    let app = router(state.clone()).into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let token = record.token.expose();

    let curl_async = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            curl(&args.iter().map(String::as_str).collect::<Vec<_>>())
        })
    };
    let (code, body) = curl_async(vec![format!("{base}/boot.ipxe")])
        .await
        .expect("curl");
    assert_eq!(code, "200");
    assert!(text(&body).starts_with("#!ipxe"));
    let (code, body) = curl_async(vec![format!("{base}/ipxe/52-54-00-10-00-01")])
        .await
        .expect("curl");
    assert_eq!(code, "200");
    assert!(
        text(&body).contains(&format!("ds=nocloud-net;s={base}/nocloud/{token}/")),
        "{}",
        text(&body)
    );
    let (code, body) = curl_async(vec![format!("{base}/nocloud/{token}/user-data")])
        .await
        .expect("curl");
    assert_eq!(code, "200");
    assert_eq!(body, user_data());
    let (code, _) = curl_async(vec![format!(
        "{base}/nocloud/{}/user-data",
        tokens::Token::mint().expose()
    )])
    .await
    .expect("curl");
    assert_eq!(code, "404");
    let (code, body) = curl_async(vec![
        "-X".into(),
        "POST".into(),
        "-H".into(),
        "Content-Type: application/json".into(),
        "--data".into(),
        r#"{"hostname":"host-0","addresses":["127.0.0.1"]}"#.into(),
        format!("{base}/callback/{token}"),
    ])
    .await
    .expect("curl");
    assert_eq!(code, "200", "{}", text(&body));
    let secret = Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .get("m1-boot")
        .await
        .expect("boot Secret");
    let recorded = tokens::parse_secret(&secret)
        .expect("parse")
        .callback
        .expect("recorded");
    assert_eq!(
        recorded.source_ip,
        Some("127.0.0.1".parse().expect("ip")),
        "the socket's peer address is recorded"
    );
}

/// A store frozen at `objects`: the boot service decides from it while the apiserver moves on,
/// which is exactly the race between a late callback and a replaced attempt.
fn frozen<K>(objects: Vec<K>) -> kube::runtime::reflector::Store<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    use kube::runtime::watcher::Event;
    let (store, mut writer) = kube::runtime::reflector::store();
    writer.apply_watcher_event(&Event::Init);
    for o in objects {
        writer.apply_watcher_event(&Event::InitApply(o));
    }
    writer.apply_watcher_event(&Event::InitDone);
    store
}

#[tokio::test]
async fn a_callback_lands_only_on_its_own_attempt_and_only_once() {
    use metalboot::api::{MetalHost, MetalMachine};
    use metalboot::boot::http::{BootConfig, BootStores};
    use metalboot::controllers::metalmachine::claim::host_index_keys;
    use metalboot::stores::Index;
    let Fixture { ns, record } = fixture("boot-late").await;
    let client = &ns.client;
    let hosts: Vec<MetalHost> = Api::namespaced(client.clone(), &ns.name)
        .list(&ListParams::default())
        .await
        .expect("hosts")
        .items;
    let machines: Vec<MetalMachine> = Api::namespaced(client.clone(), &ns.name)
        .list(&ListParams::default())
        .await
        .expect("machines")
        .items;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    let attempt_1 = secrets.get(&record.secret_name).await.expect("boot Secret");
    let frozen_stores = || {
        let store = frozen(hosts.clone());
        let host_index = Index::new(host_index_keys);
        host_index.rebuild(&store);
        BootStores {
            hosts: store,
            host_index,
            machines: frozen(machines.clone()),
            boot_secrets: frozen(vec![attempt_1.clone().into()]),
        }
    };
    let config = || BootConfig {
        base_url: BASE.into(),
        pin_source_ip: false,
        sentinel_wait_seconds: 600,
        deploy: None,
    };
    let callback = |token: &str| {
        Request::post(format!("/callback/{token}"))
            .header("content-type", "application/json")
            .body(Body::from(
                r#"{"hostname":"host-0","addresses":["10.0.2.15"]}"#,
            ))
            .expect("req")
    };

    // Attempt 1 times out and is replaced by attempt 2 (new token) in the apiserver, while the
    // boot service still sees attempt 1: the late callback of attempt 1 must be refused.
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let stale =
        Arc::new(BootState::new(frozen_stores(), config(), client.clone(), tx).expect("state"));
    stale.wait_for_stores().await;
    let user_data_request = || {
        Request::get(format!("/nocloud/{}/user-data", record.token.expose()))
            .body(Body::empty())
            .expect("req")
    };
    // Served to attempt 1 by a state of its own: a state keeps what it read per token for a few
    // seconds (`UserDataMemo`), and `stale` must read after the renewal.
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let current =
        Arc::new(BootState::new(frozen_stores(), config(), client.clone(), tx).expect("state"));
    current.wait_for_stores().await;
    let (status, body) = request(&current, user_data_request(), Some("10.0.2.15")).await;
    assert_eq!(status, StatusCode::OK, "{}", text(&body));
    assert_eq!(
        Some(body.as_slice()),
        tokens::user_data(&attempt_1),
        "served as the apiserver holds it"
    );
    secrets
        .replace(
            &record.secret_name,
            &Default::default(),
            &tokens::next_attempt(&attempt_1),
        )
        .await
        .expect("attempt 2");
    let (status, body) = request(&stale, callback(record.token.expose()), Some("10.0.2.15")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{}", text(&body));
    // The bootstrap data is read from the apiserver, not the stale store: attempt 1's token no
    // longer gets it.
    let (status, body) = request(&stale, user_data_request(), Some("10.0.2.15")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{}", text(&body));
    let attempt_2 =
        tokens::parse_secret(&secrets.get(&record.secret_name).await.expect("get")).expect("parse");
    assert_eq!(attempt_2.attempt, 2);
    assert!(
        attempt_2.callback.is_none(),
        "attempt 2 was not marked booted by attempt 1's callback"
    );

    // Twenty concurrent callbacks with one valid token: exactly one is recorded.
    let current = secrets.get(&record.secret_name).await.expect("get");
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let stores = BootStores {
        boot_secrets: frozen(vec![current.into()]),
        ..frozen_stores()
    };
    let state = Arc::new(BootState::new(stores, config(), client.clone(), tx).expect("state"));
    state.wait_for_stores().await;
    let token = attempt_2.token.expose().to_string();
    let answers = futures::future::join_all(
        (0..20).map(|_| request(&state, callback(&token), Some("10.0.2.15"))),
    )
    .await;
    let accepted = answers.iter().filter(|(s, _)| *s == StatusCode::OK).count();
    let refused = answers
        .iter()
        .filter(|(s, _)| *s == StatusCode::CONFLICT)
        .count();
    assert_eq!(
        (accepted, refused),
        (1, 19),
        "{:?}",
        answers.iter().map(|a| a.0).collect::<Vec<_>>()
    );
}

/// A token's user-data costs one apiserver read however many requests bring it: the requests
/// that come while the read is on its way join it, and repeats after its answer are served from
/// the boot service's memo.
#[tokio::test]
async fn requests_for_one_tokens_user_data_share_one_read() {
    let Fixture { ns, record } = fixture("boot-user-data-reads").await;
    let (counting, gets) =
        support::client_counting_gets(&format!("/secrets/{}", record.secret_name)).await;
    let (state, _callbacks) = boot_state(&counting, &ns.name, BASE, false).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1 && s.machines.state().len() == 1
    })
    .await;
    let path = format!("/nocloud/{}/user-data", record.token.expose());
    let together =
        futures::future::join_all((0..8).map(|_| get(&state, &path, Some("10.0.2.15")))).await;
    for (status, body) in together {
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, user_data());
    }
    let (status, body) = get(&state, &path, Some("10.0.2.15")).await;
    assert_eq!((status, body), (StatusCode::OK, user_data()), "a repeat");
    assert_eq!(
        gets.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "nine requests, one read"
    );
}
