//! The webhooks' HTTPS server: `POST /validate` (rules), `POST /inject`
//! (pods) and `POST /inject-conflict` (pods of a namespace labelled for
//! Istio's injection too: refused, with an Event on the namespace) take an
//! AdmissionReview (at most 4 MiB: the API server's objects
//! are at most 1.5 MiB), anything else is 404. HTTP/1.1 and HTTP/2 (the API
//! server speaks either).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use super::certs::Tls;
use super::inject::{self, Template};
use super::metrics::VerdictLabel;
use super::review::{review, Verdict};

/// The most an AdmissionReview may weigh.
const MAX_BODY: usize = 4 << 20;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A rustls server config for the pair (ring, TLS 1.2 and 1.3, h2 and http/1.1).
pub fn server_config(tls: &Tls) -> anyhow::Result<rustls::ServerConfig> {
    let certs = CertificateDer::pem_slice_iter(tls.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("webhook certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(tls.key.as_bytes())
        .map_err(|e| anyhow::anyhow!("webhook key: {e}"))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| anyhow::anyhow!("webhook certificate and key: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Serves reviews on `listener` until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    config: rustls::ServerConfig,
    template: Arc<Template>,
    reviews: Family<VerdictLabel, Counter>,
    events: Option<Recorder>,
) {
    let acceptor = TlsAcceptor::from(Arc::new(config));
    info!(addr = ?listener.local_addr().ok(), "admission webhook serving");
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "webhook accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let reviews = reviews.clone();
        let template = template.clone();
        let events = events.clone();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return debug!(%peer, error = %e, "webhook TLS handshake failed"),
                Err(_) => return debug!(%peer, "webhook TLS handshake timed out"),
            };
            let svc = service_fn(move |req| {
                let reviews = reviews.clone();
                let template = template.clone();
                let events = events.clone();
                async move {
                    Ok::<_, Infallible>(handle(req, &template, &reviews, events.as_ref()).await)
                }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), svc)
                .await;
        });
    }
}

async fn handle(
    req: Request<Incoming>,
    template: &Template,
    reviews: &Family<VerdictLabel, Counter>,
    events: Option<&Recorder>,
) -> Response<Full<Bytes>> {
    let webhook = match (req.method(), req.uri().path()) {
        (&Method::POST, "/validate") => "validate",
        (&Method::POST, "/inject") => "inject",
        (&Method::POST, "/inject-conflict") => "inject-conflict",
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                "the webhooks serve POST /validate, POST /inject and POST /inject-conflict\n",
            )
        }
    };
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return text(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("reading the review: {e} (at most {MAX_BODY} bytes)\n"),
            )
        }
    };
    let answer = match webhook {
        "validate" => review(&body),
        "inject-conflict" => inject::conflict_review(&body).map(|(verdict, response, ns)| {
            if let Some(events) = events {
                let events = events.clone();
                tokio::spawn(async move { conflict_event(&events, &ns).await });
            }
            (verdict, response)
        }),
        _ => inject::review(&body, template),
    };
    let (verdict, response) = match answer {
        Ok(r) => r,
        Err(reason) => {
            reviews
                .get_or_create(&VerdictLabel::of(webhook, Verdict::Malformed))
                .inc();
            return text(StatusCode::BAD_REQUEST, &format!("{reason}\n"));
        }
    };
    reviews
        .get_or_create(&VerdictLabel::of(webhook, verdict))
        .inc();
    if verdict == Verdict::Denied {
        info!(
            webhook,
            reason = response["response"]["status"]["message"]
                .as_str()
                .unwrap_or(""),
            "admission refused an object"
        );
    }
    Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            serde_json::to_vec(&response).unwrap_or_default(),
        )))
        .unwrap_or_default()
}

/// A Warning Event on the namespace whose pods were refused for carrying
/// both meshes' injection labels (repeats count up one Event's series).
async fn conflict_event(events: &Recorder, namespace: &str) {
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Namespace".into()),
        name: Some(namespace.to_string()),
        ..Default::default()
    };
    let event = Event {
        type_: EventType::Warning,
        reason: "TwoMeshesInject".into(),
        note: Some(inject::conflict_message(namespace)),
        action: "Inject".into(),
        secondary: None,
    };
    if let Err(e) = events.publish(&event, &reference).await {
        warn!(namespace, error = %e, "publishing an Event failed");
    }
}

fn text(code: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = code;
    r
}
