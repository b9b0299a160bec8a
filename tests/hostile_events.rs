//! Anonymous traffic cannot drive apiserver writes: requests that each used to write an Event are
//! counted in the apiserver's audit log. In its own binary, so the HTTP budget test's fds and
//! memory measurements (tests/hostile_http.rs) see only their own traffic.

mod support;

use std::net::SocketAddr;

/// 5. Anonymous requests that used to write an Event each: the iPXE script of a host whose
///    machine's boot profile is refused, asked for 500 times by anyone. The apiserver sees at most
///    one Event write per machine and reason per interval (the audit log counts them); the rest are
///    counted in a metric.
#[tokio::test]
async fn anonymous_requests_cannot_drive_apiserver_writes() {
    use metalboot::api::metalhost::HostState;
    use metalboot::api::metalmachine::BootProfile;
    const REQUESTS: usize = 500;
    let ns = support::namespace("hostile-events").await;
    support::boot::install_crds(&ns.client).await;
    let machine = support::boot::create_machine(
        &ns.client,
        &ns.name,
        "m1",
        BootProfile {
            kernel: "vmlinuz".into(),
            initrds: vec![],
            // iPXE would expand this: the profile is refused, with a Warning Event.
            cmdline: Some("console=ttyS0 ${net0/ip}".into()),
        },
    )
    .await;
    let mac = "52:54:00:ee:00:01";
    support::boot::create_host(&ns.client, &ns.name, "h1", mac).await;
    support::boot::set_host_state(
        &ns.client,
        &ns.name,
        "h1",
        HostState::Provisioning,
        Some(&machine),
    )
    .await;
    support::boot::create_boot_secret(&ns.client, &ns.name, &machine, "h1", b"#cloud-config\n")
        .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (state, _rx) =
        support::boot::boot_state(&ns.client, &ns.name, &format!("http://{addr}"), false).await;
    support::boot::until_stores("the attempt in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1
    })
    .await;
    let app = metalboot::boot::http::router(state.clone())
        .into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let suppressed_before = metalboot::metrics::events_suppressed("BootProfileInvalid");
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/ipxe/{}", mac.replace(':', "-"));
    let mut refused_scripts = 0;
    for _ in 0..REQUESTS {
        let script = http
            .get(&url)
            .send()
            .await
            .expect("request")
            .text()
            .await
            .expect("text");
        refused_scripts += usize::from(!script.contains("ds=nocloud"));
    }
    let suppressed =
        metalboot::metrics::events_suppressed("BootProfileInvalid") - suppressed_before;
    // The one Event that did go out is in the audit log once the apiserver answered it.
    let writes = support::eventually("the first Event is in the audit log", 30, || async {
        // Only the boot service writes Events in this namespace.
        let n = support::writes_in(&ns.name)
            .iter()
            .filter(|w| w.resource.starts_with("events/"))
            .count();
        (n >= 1).then_some(n)
    })
    .await;
    println!(
        "anonymous Event flood: {REQUESTS} script requests for a refused profile \
         ({refused_scripts} refused); budget 1 Event per machine and reason per minute; \
         apiserver Event writes {writes}, suppressed and counted {suppressed}"
    );
    assert_eq!(refused_scripts, REQUESTS, "every script is refused");
    assert_eq!(
        writes, 1,
        "one Event reaches the apiserver, not one per request"
    );
    assert_eq!(suppressed, (REQUESTS - 1) as u64, "the rest are counted");
    drop(state);
}
