//! `minimesh.v1.CertificateService` on the discovery port: a workload's
//! certificate signing request, authenticated by its token, answered with
//! a certificate naming the identity the token proves.

use std::sync::Arc;

use minimesh_proto::v1::certificate_service_server::CertificateService;
use minimesh_proto::v1::{IssueRequest, IssueResponse};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::auth::{self, Authenticator, Refused};
use super::metrics::AuthLabel;
use super::{Ca, Identity};

/// Checks workloads' credentials, logging and counting every refusal.
pub struct Auth {
    /// How tokens are checked.
    pub authenticator: Authenticator,
    /// The control plane's own identity (Kubernetes: its service account),
    /// which may speak for every namespace: a replica passing its sidecars'
    /// load reports on to the leader.
    pub control_plane: Option<Identity>,
    /// Refusals, by service and reason.
    pub refusals: Family<AuthLabel, Counter>,
    /// Refusals are logged at most once a second per service and reason.
    pub log: RefusalLog,
}

/// Lets a refusal's log line through at most once a second per service
/// and reason, counting those held back.
#[derive(Debug, Default)]
pub struct RefusalLog(std::sync::Mutex<std::collections::HashMap<RefusalKind, LastLine>>);

/// A refusal's service and reason.
type RefusalKind = (&'static str, &'static str);

/// When a kind's line last went out, and how many were held back since.
type LastLine = (std::time::Instant, u64);

impl RefusalLog {
    /// Some(lines held back since the last) when this one may go out.
    pub fn pass(&self, service: &'static str, reason: &'static str) -> Option<u64> {
        let mut lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        match lines.get_mut(&(service, reason)) {
            Some((last, held)) if now.duration_since(*last) < std::time::Duration::from_secs(1) => {
                *held += 1;
                None
            }
            Some((last, held)) => {
                *last = now;
                Some(std::mem::take(held))
            }
            None => {
                lines.insert((service, reason), (now, 0));
                Some(0)
            }
        }
    }
}

impl Auth {
    /// The identity a call to `service` from `peer` proves, or the refusal
    /// as a status.
    pub async fn check(
        &self,
        service: &'static str,
        metadata: &tonic::metadata::MetadataMap,
        peer: Option<std::net::IpAddr>,
    ) -> Result<Identity, Status> {
        let checked = match auth::bearer(metadata) {
            Ok(token) => self.authenticator.authenticate(token, peer).await,
            Err(e) => Err(e),
        };
        checked.map_err(|e| self.refuse(service, &e))
    }

    /// Checks that `who` may speak for a proxy of `namespace` on `service`.
    pub fn check_namespace(
        &self,
        service: &'static str,
        who: &Identity,
        namespace: &str,
    ) -> Result<(), Status> {
        auth::may_speak_for(who, namespace, self.control_plane.as_ref())
            .map_err(|e| self.refuse(service, &e))
    }

    /// Checks that `who` may name itself `node` on `service`: its
    /// namespace, its pod (a bound token's), and the forwarder's prefix
    /// only for the control plane's own identity.
    pub fn check_node(
        &self,
        service: &'static str,
        who: &Identity,
        node: &minimesh_proto::v1::Node,
    ) -> Result<(), Status> {
        auth::may_name(who, node, self.control_plane.as_ref()).map_err(|e| self.refuse(service, &e))
    }

    fn refuse(&self, service: &'static str, e: &Refused) -> Status {
        // At most a line a second: a flood of bad tokens is counted, not
        // written out one by one.
        if let Some(held) = self.log.pass(service, e.reason()) {
            warn!(service, reason = e.reason(), also_refused = held, "refused: {e} (at most one line a second; also_refused counts the others since the last)");
        }
        self.refusals
            .get_or_create(&AuthLabel {
                service,
                reason: e.reason(),
            })
            .inc();
        match e {
            Refused::Unavailable(_) | Refused::RateLimited(_) => Status::unavailable(e.to_string()),
            _ => Status::unauthenticated(e.to_string()),
        }
    }
}

/// The certificate service.
#[derive(Clone)]
pub struct Certificates {
    /// The CA.
    pub ca: Arc<Ca>,
    /// Credentials.
    pub auth: Arc<Auth>,
    /// Certificates issued.
    pub issued: Counter,
}

impl Certificates {
    /// The certificate service of `ca`, callers checked by `auth`, and the
    /// discovery port's TLS: a certificate the CA signs now for the control
    /// plane's names (its Service's in `POD_NAMESPACE`, `localhost`, its
    /// `POD_IP`, the address of `xds`).
    pub fn serve(
        ca: Ca,
        auth: Auth,
        metrics: &super::metrics::Metrics,
        xds: std::net::SocketAddr,
    ) -> anyhow::Result<(Certificates, tonic::transport::ServerTlsConfig)> {
        let namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "minimesh-system".into());
        let pod_ip = std::env::var("POD_IP").ok().filter(|ip| !ip.is_empty());
        let names = super::serving_names(xds, &namespace, pod_ip.as_deref());
        let (cert, key) = ca.serving(&names)?;
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert, key));
        let certificates = Certificates {
            ca: Arc::new(ca),
            auth: Arc::new(auth),
            issued: metrics.certificates_issued.clone(),
        };
        Ok((certificates, tls))
    }
}

#[tonic::async_trait]
impl CertificateService for Certificates {
    async fn issue(&self, req: Request<IssueRequest>) -> Result<Response<IssueResponse>, Status> {
        let peer = req.remote_addr().map(|a| a.ip());
        let who = self
            .auth
            .check("certificates", req.metadata(), peer)
            .await?;
        let issued = self
            .ca
            .issue(&req.get_ref().csr_pem, &who)
            .map_err(Status::invalid_argument)?;
        self.issued.inc();
        let not_after = issued
            .not_after
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        info!(spiffe_id = %issued.spiffe_id, not_after, "issued a workload certificate");
        Ok(Response::new(IssueResponse {
            cert_chain_pem: vec![issued.cert_pem],
            root_pem: self.ca.root_pem().to_string(),
            not_after_unix: not_after,
            spiffe_id: issued.spiffe_id,
        }))
    }
}
