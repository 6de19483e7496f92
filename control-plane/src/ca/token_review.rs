//! Who a workload is on Kubernetes: its projected service-account token
//! (audience `minimesh`), reviewed by the API server (the TokenReview API,
//! as Istio's CA and Linkerd's identity service do). What a bad token can
//! cost is bounded: answers are cached (a sidecar's reconnects and its two
//! streams cost one review), good answers apart from refusals (so that a
//! flood of bad tokens never evicts them), reviews in flight are capped,
//! and a peer that keeps sending tokens the API server refuses is refused
//! without a review for a while. Each outcome is counted
//! (`minimesh_token_reviews_total{result}`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::auth::Refused;
use super::metrics::ReviewLabel;
use super::Identity;

/// How long an accepted token is taken without asking again. Short against
/// a bound token's life (an hour): a deleted pod's token stops working
/// within this long.
const ACCEPTED_FOR: Duration = Duration::from_secs(60);

/// How long a refused token stays refused without asking again.
const REFUSED_FOR: Duration = Duration::from_secs(5);

/// Good answers remembered at most (a cluster's workloads' tokens); past
/// this, expired ones are forgotten, and a new one is reviewed each time.
const ACCEPTED_ENTRIES: usize = 100_000;

/// Refusals remembered at most; past this, forgotten (never a good answer).
const REFUSED_ENTRIES: usize = 10_000;

/// Reviews in flight at most: beyond, a call waits this long for a turn,
/// then is answered UNAVAILABLE (its client retries).
pub const MAX_REVIEWS_IN_FLIGHT: usize = 16;
const REVIEW_WAIT: Duration = Duration::from_secs(2);

/// Refused tokens a peer address may send before it is refused without a
/// review, and how many a second it earns back.
const PEER_BURST: f64 = 20.0;
const PEER_REFILL_PER_SEC: f64 = 5.0;
/// Peers tracked at most; past this, those with a full allowance go.
const PEER_ENTRIES: usize = 10_000;

/// The key of a bound token's pod name in a review's `user.extra`.
const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";

/// The prefix of a service account's user name in a review.
const SERVICE_ACCOUNT_USER: &str = "system:serviceaccount:";

/// A peer's allowance of refused tokens: (tokens left, when last counted).
type Allowance = (f64, Instant);

/// Reviews tokens with the API server.
pub struct TokenReviewer {
    client: kube::Client,
    audience: String,
    accepted: Mutex<HashMap<String, (Identity, Instant)>>,
    refused: Mutex<HashMap<String, (Refused, Instant)>>,
    peers: Mutex<HashMap<IpAddr, Allowance>>,
    in_flight: tokio::sync::Semaphore,
    outcomes: Family<ReviewLabel, Counter>,
}

impl TokenReviewer {
    /// Reviews with `client`'s API server, for `audience` (`--token-audience`),
    /// counting outcomes in `outcomes`.
    pub fn new(
        client: kube::Client,
        audience: &str,
        outcomes: Family<ReviewLabel, Counter>,
    ) -> TokenReviewer {
        TokenReviewer {
            client,
            audience: audience.to_string(),
            accepted: Mutex::default(),
            refused: Mutex::default(),
            peers: Mutex::default(),
            in_flight: tokio::sync::Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
            outcomes,
        }
    }

    fn count(&self, result: &'static str) {
        self.outcomes.get_or_create(&ReviewLabel { result }).inc();
    }

    /// The identity `token`, sent from `peer`, proves.
    pub async fn authenticate(
        &self,
        token: &str,
        peer: Option<IpAddr>,
    ) -> Result<Identity, Refused> {
        let now = Instant::now();
        if let Some((who, until)) = lock(&self.accepted).get(token) {
            if *until > now {
                self.count("cached");
                return Ok(who.clone());
            }
        }
        if let Some((why, until)) = lock(&self.refused).get(token) {
            if *until > now {
                self.count("cached");
                return Err(why.clone());
            }
        }
        // A review is taken from the peer's allowance before it is made
        // (so reviews in flight cannot overdraw it) and given back unless
        // the API server refused the token.
        if let Some(ip) = peer {
            if !self.take(ip, now) {
                self.count("rate_limited");
                return Err(Refused::RateLimited(ip.to_string()));
            }
        }
        let Ok(Ok(_turn)) = tokio::time::timeout(REVIEW_WAIT, self.in_flight.acquire()).await
        else {
            if let Some(ip) = peer {
                self.give_back(ip);
            }
            self.count("busy");
            return Err(Refused::Unavailable(format!(
                "{MAX_REVIEWS_IN_FLIGHT} token reviews are in flight; retry"
            )));
        };
        let answer = self.review(token).await;
        let now = Instant::now();
        if let (Some(ip), Ok(_) | Err(Refused::Unavailable(_))) = (peer, &answer) {
            self.give_back(ip);
        }
        match &answer {
            Ok(who) => {
                self.count("accepted");
                let mut accepted = lock(&self.accepted);
                if accepted.len() >= ACCEPTED_ENTRIES {
                    accepted.retain(|_, (_, until)| *until > now);
                }
                if accepted.len() < ACCEPTED_ENTRIES {
                    accepted.insert(token.to_string(), (who.clone(), now + ACCEPTED_FOR));
                }
            }
            // The API server's trouble is not the token's: ask again next time.
            Err(Refused::Unavailable(_)) => self.count("unavailable"),
            Err(why) => {
                self.count("refused");
                let mut refused = lock(&self.refused);
                if refused.len() >= REFUSED_ENTRIES {
                    refused.retain(|_, (_, until)| *until > now);
                    if refused.len() >= REFUSED_ENTRIES {
                        refused.clear();
                    }
                }
                refused.insert(token.to_string(), (why.clone(), now + REFUSED_FOR));
            }
        }
        answer
    }

    /// Takes one review from `ip`'s allowance; false when none is left.
    fn take(&self, ip: IpAddr, now: Instant) -> bool {
        let mut peers = lock(&self.peers);
        if peers.len() >= PEER_ENTRIES && !peers.contains_key(&ip) {
            // Forget the peers whose allowance is whole again.
            peers.retain(|_, (left, at)| {
                *left + now.duration_since(*at).as_secs_f64() * PEER_REFILL_PER_SEC < PEER_BURST
            });
            if peers.len() >= PEER_ENTRIES {
                return true;
            }
        }
        let (left, at) = peers.entry(ip).or_insert((PEER_BURST, now));
        *left =
            (*left + now.duration_since(*at).as_secs_f64() * PEER_REFILL_PER_SEC).min(PEER_BURST);
        *at = now;
        if *left < 1.0 {
            return false;
        }
        *left -= 1.0;
        true
    }

    /// Gives a review back to `ip`'s allowance (the token was good, or the
    /// API server could not say).
    fn give_back(&self, ip: IpAddr) {
        if let Some((left, _)) = lock(&self.peers).get_mut(&ip) {
            *left = (*left + 1.0).min(PEER_BURST);
        }
    }

    async fn review(&self, token: &str) -> Result<Identity, Refused> {
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let answered = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| Refused::Unavailable(e.to_string()))?;
        let status = answered.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let error = status.error.unwrap_or_default();
            return Err(Refused::NotAuthenticated(if error.is_empty() {
                "not authenticated".into()
            } else {
                error
            }));
        }
        // Authenticated for some audience of ours: say which, or trust the
        // request's (an API server answers for the audiences it was asked).
        if let Some(audiences) = status.audiences.as_ref().filter(|a| !a.is_empty()) {
            if !audiences.contains(&self.audience) {
                return Err(Refused::NotAuthenticated(format!(
                    "the token is for {audiences:?}, not {:?}",
                    self.audience
                )));
            }
        }
        workload(status.user.unwrap_or_default())
    }
}

/// The identity of a reviewed token's user: its service account, and the
/// pod a bound token (projected: every injected pod's) names in `extra`.
fn workload(user: k8s_openapi::api::authentication::v1::UserInfo) -> Result<Identity, Refused> {
    let name = user.username.clone().unwrap_or_default();
    let mut who = service_account(&name).ok_or(Refused::NotWorkload(name))?;
    who.pod = user
        .extra
        .as_ref()
        .and_then(|e| e.get(POD_NAME_EXTRA))
        .and_then(|v| v.first())
        .filter(|p| !p.is_empty())
        .cloned();
    Ok(who)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The identity of a service account's user name
/// (`system:serviceaccount:<namespace>:<name>`).
pub fn service_account(user: &str) -> Option<Identity> {
    let (namespace, name) = user.strip_prefix(SERVICE_ACCOUNT_USER)?.split_once(':')?;
    (!namespace.is_empty() && !name.is_empty() && !name.contains(':')).then(|| Identity {
        pod: None,
        namespace: namespace.to_string(),
        service_account: name.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_tokens_pod_is_its_workload() {
        use k8s_openapi::api::authentication::v1::UserInfo;
        let bound = UserInfo {
            username: Some("system:serviceaccount:default:web".into()),
            extra: Some(
                [(
                    POD_NAME_EXTRA.to_string(),
                    vec!["web-7d9f-x2k4p".to_string()],
                )]
                .into(),
            ),
            ..Default::default()
        };
        let who = workload(bound).expect("a workload");
        assert_eq!(who.pod.as_deref(), Some("web-7d9f-x2k4p"));
        assert_eq!(who.reporter(), "web-7d9f-x2k4p.default");
        let unbound = UserInfo {
            username: Some("system:serviceaccount:default:web".into()),
            ..Default::default()
        };
        let who = workload(unbound).expect("a workload");
        assert_eq!(who.reporter(), "sa/web.default");
        assert_eq!(who.pod, None);
    }

    #[test]
    fn only_service_accounts_are_workloads() {
        assert_eq!(
            service_account("system:serviceaccount:default:simple-web"),
            Some(Identity {
                pod: None,
                namespace: "default".into(),
                service_account: "simple-web".into()
            })
        );
        for user in [
            "kubernetes-admin",
            "system:node:kind-worker",
            "system:serviceaccount:default",
            "system:serviceaccount::web",
            "system:serviceaccount:default:a:b",
        ] {
            assert_eq!(service_account(user), None, "{user}");
        }
    }
}
