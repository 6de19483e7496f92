//! Who a workload is: the bearer token on its gRPC calls, checked against a
//! tokens file (the local mesh, where `minimesh up` writes one token per
//! pod). The refusals' texts are the ones callers and logs see.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::Deserialize;

use super::Identity;

/// Why a call's credentials were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The call carries no token.
    #[error("missing credentials: the call has no `authorization: Bearer <token>` metadata")]
    Missing,
    /// The token proves no identity.
    #[error("invalid credentials: the token is not one this control plane knows")]
    Invalid,
    /// The API server's TokenReview did not authenticate the token.
    #[error("invalid credentials: the API server did not authenticate the token: {0}")]
    NotAuthenticated(String),
    /// The token is a user's, not a workload's.
    #[error("invalid credentials: {0:?} is not a service account")]
    NotWorkload(String),
    /// The API server could not be asked.
    #[error("credentials not checked: the API server's TokenReview failed: {0}")]
    Unavailable(String),
    /// The peer sent too many tokens the API server refused: not reviewed.
    #[error("credentials not checked: {0} sent too many invalid tokens; retry later")]
    RateLimited(String),
    /// The identity may not speak for the node the call names.
    #[error("the token's identity ({who}) may not speak for namespace {namespace:?}")]
    WrongNamespace {
        /// The identity's SPIFFE path (`ns/<ns>/sa/<sa>`).
        who: String,
        /// The namespace the call claims.
        namespace: String,
    },
    /// The token is bound to another pod than the node names.
    #[error("the token is bound to pod {pod:?}; the node names workload {workload:?}")]
    WrongWorkload {
        /// The token's pod.
        pod: String,
        /// The workload the node names.
        workload: String,
    },
    /// A node id with the forwarder's prefix from another identity.
    #[error("node id {node:?}: the prefix minimesh-forwarder/ is the control plane's own (replicas passing on load reports); the token's identity ({who}) is not")]
    NotForwarder {
        /// The node id.
        node: String,
        /// The identity's SPIFFE path.
        who: String,
    },
}

impl Refused {
    /// The metric label of the refusal.
    pub fn reason(&self) -> &'static str {
        match self {
            Refused::Missing => "missing",
            Refused::Invalid | Refused::NotAuthenticated(_) | Refused::NotWorkload(_) => "invalid",
            Refused::Unavailable(_) => "unavailable",
            Refused::RateLimited(_) => "rate_limited",
            Refused::WrongNamespace { .. } => "namespace",
            Refused::WrongWorkload { .. } => "workload",
            Refused::NotForwarder { .. } => "forwarder",
        }
    }
}

/// The token of a call's `authorization: Bearer` metadata.
pub fn bearer(metadata: &tonic::metadata::MetadataMap) -> Result<&str, Refused> {
    metadata
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(Refused::Missing)
}

/// How workloads prove who they are.
pub enum Authenticator {
    /// A tokens file (`--workload-tokens`; the local mesh).
    Tokens(Tokens),
    /// Projected service-account tokens, reviewed by the API server.
    Kubernetes(Box<super::token_review::TokenReviewer>),
}

impl Authenticator {
    /// The identity `token`, sent from `peer`, proves.
    pub async fn authenticate(
        &self,
        token: &str,
        peer: Option<std::net::IpAddr>,
    ) -> Result<Identity, Refused> {
        match self {
            Authenticator::Tokens(t) => t.authenticate(token),
            Authenticator::Kubernetes(r) => r.authenticate(token, peer).await,
        }
    }
}

/// Checks that `who` may speak for a proxy of `namespace`. `control_plane`
/// (the control plane's own identity: a replica passing its sidecars'
/// load reports to the leader) speaks for every namespace.
pub fn may_speak_for(
    who: &Identity,
    namespace: &str,
    control_plane: Option<&Identity>,
) -> Result<(), Refused> {
    if who.namespace == namespace || control_plane.is_some_and(|cp| cp.same_account(who)) {
        return Ok(());
    }
    Err(Refused::WrongNamespace {
        who: format!("ns/{}/sa/{}", who.namespace, who.service_account),
        namespace: namespace.to_string(),
    })
}

/// Checks that `who` may name itself `node`: in its namespace (see
/// [`may_speak_for`]), as its pod when its token is bound to one (a node
/// naming no workload is keyed by the pod anyway), and with the forwarder's
/// node id prefix only as the control plane.
pub fn may_name(
    who: &Identity,
    node: &minimesh_proto::v1::Node,
    control_plane: Option<&Identity>,
) -> Result<(), Refused> {
    // The control plane (a replica passing on its sidecars' reports, each
    // naming its sidecar) speaks for every node.
    if control_plane.is_some_and(|cp| cp.same_account(who)) {
        return Ok(());
    }
    let path = || format!("ns/{}/sa/{}", who.namespace, who.service_account);
    if node.id.starts_with(minimesh_proto::FORWARDER_NODE_PREFIX) {
        return Err(Refused::NotForwarder {
            node: node.id.clone(),
            who: path(),
        });
    }
    may_speak_for(who, &node.namespace, control_plane)?;
    match &who.pod {
        Some(pod) if !node.workload.is_empty() && node.workload != *pod => {
            Err(Refused::WrongWorkload {
                pod: pod.clone(),
                workload: node.workload.clone(),
            })
        }
        _ => Ok(()),
    }
}

/// The tokens file (`--workload-tokens`):
///
/// ```yaml
/// tokens:
/// - token: 3f9c…            # at least 16 characters
///   namespace: default
///   serviceAccount: simple-web
/// ```
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TokenEntry {
    token: String,
    namespace: String,
    service_account: String,
    /// The one workload (pod) the token is for, as a bound token's.
    #[serde(default)]
    pod: Option<String>,
}

/// Tokens read from a file, read again when it changes.
pub struct Tokens {
    path: PathBuf,
    state: Mutex<(Option<SystemTime>, HashMap<String, Identity>)>,
}

impl Tokens {
    /// Reads `path`; Err names the file and what is wrong with it.
    pub fn load(path: &Path) -> anyhow::Result<Tokens> {
        let (mtime, map) = read(path)?;
        Ok(Tokens {
            path: path.to_path_buf(),
            state: Mutex::new((mtime, map)),
        })
    }

    /// The identity `token` proves.
    pub fn authenticate(&self, token: &str) -> Result<Identity, Refused> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(who) = state.1.get(token) {
            return Ok(who.clone());
        }
        // Unknown: the file may have gained it since (a pod added).
        let mtime = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        if mtime != state.0 {
            match read(&self.path) {
                Ok(fresh) => *state = fresh,
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "keeping the tokens last read"),
            }
        }
        state.1.get(token).cloned().ok_or(Refused::Invalid)
    }
}

type Read = (Option<SystemTime>, HashMap<String, Identity>);

fn read(path: &Path) -> anyhow::Result<Read> {
    use anyhow::Context;
    let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--workload-tokens: reading {}", path.display()))?;
    let file: TokensFile = serde_saphyr::from_str(&text)
        .with_context(|| format!("--workload-tokens: {}", path.display()))?;
    let mut map = HashMap::new();
    for (i, t) in file.tokens.into_iter().enumerate() {
        if t.token.len() < 16 {
            anyhow::bail!(
                "--workload-tokens: {}: tokens[{i}].token: shorter than 16 characters",
                path.display()
            );
        }
        map.insert(
            t.token,
            Identity {
                namespace: t.namespace,
                service_account: t.service_account,
                pod: t.pod,
            },
        );
    }
    Ok((mtime, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_prove_their_identity_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("minimesh-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("tokens.yaml");
        std::fs::write(
            &path,
            "tokens:\n- token: aaaaaaaaaaaaaaaaaaaa\n  namespace: default\n  serviceAccount: web\n",
        )
        .expect("write");
        let t = Tokens::load(&path).expect("load");
        let web = t.authenticate("aaaaaaaaaaaaaaaaaaaa").expect("known");
        assert_eq!(web.spiffe_id("td"), "spiffe://td/ns/default/sa/web");
        assert_eq!(
            t.authenticate("bbbbbbbbbbbbbbbbbbbb"),
            Err(Refused::Invalid)
        );
        assert_eq!(may_speak_for(&web, "default", None), Ok(()));
        assert_eq!(may_speak_for(&web, "kube-system", Some(&web)), Ok(()));
        assert_eq!(
            may_speak_for(&web, "kube-system", None).map_err(|e| e.to_string()),
            Err("the token's identity (ns/default/sa/web) may not speak for namespace \"kube-system\"".into())
        );
        let mut md = tonic::metadata::MetadataMap::new();
        assert_eq!(bearer(&md), Err(Refused::Missing));
        md.insert("authorization", "Bearer xyz".parse().expect("value"));
        assert_eq!(bearer(&md), Ok("xyz"));
        std::fs::write(
            &path,
            "tokens:\n- token: short\n  namespace: d\n  serviceAccount: s\n",
        )
        .expect("write");
        let e = format!("{:#}", Tokens::load(&path).err().expect("refused"));
        assert!(
            e.contains("tokens[0].token: shorter than 16 characters"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
