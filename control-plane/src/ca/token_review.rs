//! Who a workload is on Kubernetes: its projected service-account token
//! (audience `minimesh`), reviewed by the API server (the TokenReview API,
//! as Istio's CA and Linkerd's identity service do). The answer is cached
//! briefly, so that a sidecar's reconnects and its two streams cost one
//! review, and a flood of bad tokens cannot become a flood of reviews.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::{Api, PostParams};

use super::auth::Refused;
use super::Identity;

/// How long an accepted token is taken without asking again. Short against
/// a bound token's life (an hour): a deleted pod's token stops working
/// within this long.
const ACCEPTED_FOR: Duration = Duration::from_secs(60);

/// How long a refused token stays refused without asking again.
const REFUSED_FOR: Duration = Duration::from_secs(5);

/// Tokens remembered at most; past this, forgotten (expired first).
const CACHE_ENTRIES: usize = 10_000;

/// The prefix of a service account's user name in a review.
const SERVICE_ACCOUNT_USER: &str = "system:serviceaccount:";

/// Answers remembered: token -> (the answer, until when).
type Answers = HashMap<String, (Result<Identity, Refused>, Instant)>;

/// Reviews tokens with the API server.
pub struct TokenReviewer {
    client: kube::Client,
    audience: String,
    cache: Mutex<Answers>,
}

impl TokenReviewer {
    /// Reviews with `client`'s API server, for `audience` (`--token-audience`).
    pub fn new(client: kube::Client, audience: &str) -> TokenReviewer {
        TokenReviewer {
            client,
            audience: audience.to_string(),
            cache: Mutex::default(),
        }
    }

    /// The identity `token` proves.
    pub async fn authenticate(&self, token: &str) -> Result<Identity, Refused> {
        let now = Instant::now();
        if let Some((answer, until)) = self.lock().get(token) {
            if *until > now {
                return answer.clone();
            }
        }
        let answer = self.review(token).await;
        let ttl = match &answer {
            Ok(_) => ACCEPTED_FOR,
            // The API server's trouble is not the token's: ask again next time.
            Err(Refused::Unavailable(_)) => return answer,
            Err(_) => REFUSED_FOR,
        };
        let mut cache = self.lock();
        if cache.len() >= CACHE_ENTRIES {
            cache.retain(|_, (_, until)| *until > now);
            if cache.len() >= CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(token.to_string(), (answer.clone(), now + ttl));
        answer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Answers> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
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
        let user = status.user.and_then(|u| u.username).unwrap_or_default();
        service_account(&user).ok_or(Refused::NotWorkload(user))
    }
}

/// The identity of a service account's user name
/// (`system:serviceaccount:<namespace>:<name>`).
pub fn service_account(user: &str) -> Option<Identity> {
    let (namespace, name) = user.strip_prefix(SERVICE_ACCOUNT_USER)?.split_once(':')?;
    (!namespace.is_empty() && !name.is_empty() && !name.contains(':')).then(|| Identity {
        namespace: namespace.to_string(),
        service_account: name.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_service_accounts_are_workloads() {
        assert_eq!(
            service_account("system:serviceaccount:default:simple-web"),
            Some(Identity {
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
