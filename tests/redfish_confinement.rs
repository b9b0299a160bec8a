//! A rogue BMC whose replies name URLs on another origin (a session service, a reset target):
//! the driver refuses to follow them, and a second listener standing for that origin sees no
//! request at all, so neither the password nor a session token can leave for it. Replies are read
//! only up to their cap.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{any, get};
use metalboot::bmc::redfish::{MAX_REPLY_BYTES, RedfishBmc, RedfishOptions};
use metalboot::bmc::{Bmc, Credentials, PowerAction};
use serde_json::json;

const PASSWORD: &str = "rogue-bmc-must-never-see-this-elsewhere";

async fn listen(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// The other origin: counts whatever reaches it.
async fn elsewhere() -> (SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .fallback(any(|State(hits): State<Arc<AtomicUsize>>| async move {
            hits.fetch_add(1, Ordering::SeqCst);
            StatusCode::CREATED
        }))
        .with_state(hits.clone());
    (listen(app).await, hits)
}

fn driver(bmc: SocketAddr) -> RedfishBmc {
    RedfishBmc::new(
        &format!("redfish+http://{bmc}/redfish/v1/Systems/1"),
        Credentials::new("admin", PASSWORD),
        RedfishOptions::default(),
    )
    .expect("driver")
}

#[tokio::test]
async fn a_session_service_on_another_origin_is_never_sent_the_password() {
    let (evil, hits) = elsewhere().await;
    let root = json!({
        "@odata.id": "/redfish/v1",
        "SessionService": {"@odata.id": "/redfish/v1/SessionService"},
        "Links": {"Sessions": {"@odata.id": format!("http://{evil}/redfish/v1/SessionService/Sessions")}},
        "Systems": {"@odata.id": "/redfish/v1/Systems"},
    });
    let bmc = listen(Router::new().route(
        "/redfish/v1/",
        get(move || {
            let root = root.clone();
            async move { axum::Json(root) }
        }),
    ))
    .await;
    let error = driver(bmc)
        .power_state()
        .await
        .expect_err("the login must be refused")
        .to_string();
    println!("rogue session service: {error}");
    assert!(error.contains("refused to follow"), "{error}");
    assert!(error.contains("another origin"), "{error}");
    assert!(!error.contains(PASSWORD));
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "nothing reached the other origin"
    );
}

#[tokio::test]
async fn a_reset_target_on_another_origin_is_refused() {
    let (evil, hits) = elsewhere().await;
    let system = json!({
        "@odata.id": "/redfish/v1/Systems/1",
        "PowerState": "Off",
        "Actions": {"#ComputerSystem.Reset": {
            "target": format!("http://{evil}/redfish/v1/Systems/1/Actions/ComputerSystem.Reset"),
            "ResetType@Redfish.AllowableValues": ["On", "ForceOff", "GracefulShutdown", "ForceRestart"],
        }},
    });
    // No session service: HTTP basic auth, sent with every request, so any followed URL leaks.
    let bmc = listen(
        Router::new()
            .route(
                "/redfish/v1/",
                get(|| async {
                    axum::Json(json!({"@odata.id": "/redfish/v1", "Systems": {"@odata.id": "/redfish/v1/Systems"}}))
                }),
            )
            .route(
                "/redfish/v1/Systems/1",
                get(move || {
                    let system = system.clone();
                    async move { axum::Json(system) }
                }),
            ),
    )
    .await;
    let bmc = driver(bmc);
    assert_eq!(
        bmc.power_state()
            .await
            .expect("power state from the BMC itself"),
        metalboot::bmc::PowerState::Off
    );
    let error = bmc
        .power(PowerAction::On)
        .await
        .expect_err("the reset must be refused")
        .to_string();
    println!("rogue reset target: {error}");
    assert!(error.contains("refused to follow"), "{error}");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "nothing reached the other origin"
    );
}

#[tokio::test]
async fn an_oversized_reply_is_cut_off() {
    let bmc = listen(Router::new().route(
        "/redfish/v1/",
        get(|| async { (StatusCode::OK, vec![b' '; MAX_REPLY_BYTES + 1]).into_response() }),
    ))
    .await;
    let error = driver(bmc)
        .power_state()
        .await
        .expect_err("an oversized reply is an error")
        .to_string();
    assert!(error.contains("reply larger than"), "{error}");
}
