//! The objects that decide who speaks mutual TLS: a `PeerAuthentication`
//! (Istio's shape: how a namespace's sidecars, or the mesh's, treat
//! plaintext) and the `Pod`s that run a sidecar (their endpoints are called
//! over mutual TLS).

use serde::{Deserialize, Serialize};

use super::kube::ObjectMeta;
use minimesh_proto::v1::MtlsMode;

/// The namespace whose PeerAuthentication applies mesh-wide (the control
/// plane's own, as Istio's root namespace `istio-system`).
pub const ROOT_NAMESPACE: &str = "minimesh-system";

/// The label the injector puts on a pod it gives a sidecar; `minimesh up`
/// writes it on every pod.
pub const PROXY_LABEL: &str = "minimesh.io/proxy";

/// The pod annotation naming its sidecar's inbound port (the injector's).
pub const INBOUND_PORT_ANNOTATION: &str = "minimesh.io/inbound-port";

/// The injector's inbound port when the annotation names none.
pub const DEFAULT_INBOUND_PORT: u16 = 9090;

/// The pod annotation saying its connections are captured (the injector's,
/// and `minimesh up --capture`'s): every inbound port the capture rules
/// take goes through its sidecar.
pub const CAPTURE_ANNOTATION: &str = "minimesh.io/capture";

/// A `PeerAuthentication` (`security.istio.io/v1` or minimesh's group).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerAuthentication {
    /// Object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    #[serde(default)]
    pub spec: PeerAuthenticationSpec,
}

/// `PeerAuthentication.spec`: namespace-wide (or, in the root namespace,
/// mesh-wide) only. On Kubernetes it is also the spec of the
/// `minimesh.io/v1alpha1` CRD (`crds/`), generated from these types.
#[derive(
    Clone,
    Debug,
    Default,
    PartialEq,
    Deserialize,
    Serialize,
    schemars::JsonSchema,
    kube::CustomResource,
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[kube(
    group = "minimesh.io",
    version = "v1alpha1",
    kind = "PeerAuthentication",
    root = "PeerAuthenticationResource",
    namespaced,
    shortname = "mpa",
    category = "minimesh",
    doc = "How the sidecars of a namespace (in minimesh-system: of the mesh) treat plaintext: Istio's PeerAuthentication, namespace-wide.",
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mtls.mode")
)]
pub struct PeerAuthenticationSpec {
    /// Workload selector: not supported (refused with a reason; a
    /// PeerAuthentication applies to its whole namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "super::crd::any_object")]
    pub selector: Option<serde_json::Value>,
    /// The mode.
    #[serde(default)]
    pub mtls: Option<Mtls>,
    /// Per-port modes: not supported (refused with a reason).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "super::crd::any_object")]
    pub port_level_mtls: Option<serde_json::Value>,
}

/// `spec.mtls`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Mtls {
    /// `UNSET` (inherit the mesh-wide mode; PERMISSIVE when none),
    /// `PERMISSIVE` (mutual TLS and plaintext accepted) or `STRICT`
    /// (plaintext refused).
    #[serde(default)]
    pub mode: Option<String>,
}

impl PeerAuthentication {
    /// The mode it sets, or the field and reason it is refused for.
    pub fn mode(&self) -> Result<MtlsMode, (String, String)> {
        if self.spec.selector.is_some() {
            return Err((
                "spec.selector".into(),
                "workload selectors are not supported: a PeerAuthentication applies to its whole namespace (or, in minimesh-system, to the mesh)".into(),
            ));
        }
        if self.spec.port_level_mtls.is_some() {
            return Err((
                "spec.portLevelMtls".into(),
                "per-port modes are not supported".into(),
            ));
        }
        let mode = self.spec.mtls.as_ref().and_then(|m| m.mode.as_deref());
        match mode.unwrap_or("UNSET") {
            "UNSET" => Ok(MtlsMode::Unset),
            "PERMISSIVE" => Ok(MtlsMode::MtlsPermissive),
            "STRICT" => Ok(MtlsMode::MtlsStrict),
            "DISABLE" => Err((
                "spec.mtls.mode".into(),
                "DISABLE is not supported: a minimesh sidecar always accepts mutual TLS (PERMISSIVE accepts plaintext too)".into(),
            )),
            other => Err((
                "spec.mtls.mode".into(),
                format!("{other:?} is not one of UNSET, PERMISSIVE, STRICT"),
            )),
        }
    }
}

/// A `Pod`: the fields that say whether it runs a sidecar.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pod {
    /// Object metadata (its labels).
    pub metadata: ObjectMeta,
    /// Its spec (its service account).
    #[serde(default)]
    pub spec: PodSpec,
    /// Its status (its address).
    #[serde(default)]
    pub status: PodStatus,
}

/// `Pod.spec` (the field minimesh uses).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    /// The service account its workload runs as (`default` when unset).
    #[serde(default)]
    pub service_account_name: Option<String>,
}

/// `Pod.status` (the fields minimesh uses).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    /// The pod's addresses.
    #[serde(default)]
    pub pod_ips: Vec<PodIp>,
    /// Its primary address.
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
}

/// One of `status.podIPs`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct PodIp {
    /// The address.
    pub ip: String,
}

impl Pod {
    /// True when the pod runs a minimesh sidecar.
    pub fn meshed(&self) -> bool {
        self.metadata.labels.get(PROXY_LABEL).map(String::as_str) == Some("sidecar")
    }

    /// The port its sidecar takes mutual TLS on: the other ports of the
    /// pod are its app's, in plaintext.
    pub fn inbound_port(&self) -> u16 {
        self.metadata
            .annotations
            .get(INBOUND_PORT_ANNOTATION)
            .and_then(|p| p.parse().ok())
            .unwrap_or(DEFAULT_INBOUND_PORT)
    }

    /// When its connections are captured, which inbound ports its sidecar
    /// takes (from Istio's `traffic.sidecar.istio.io/*` annotations, as its
    /// init step read them); None when only its inbound port is the sidecar's.
    pub fn capture(&self) -> Option<minimesh_proto::capture::CaptureSettings> {
        if self
            .metadata
            .annotations
            .get(CAPTURE_ANNOTATION)
            .map(String::as_str)
            != Some("enabled")
        {
            return None;
        }
        let annotations = self.metadata.annotations.iter();
        minimesh_proto::capture::CaptureSettings::from_annotations(
            annotations.map(|(k, v)| (k.as_str(), v.as_str())),
        )
        .ok()
    }

    /// The identity its sidecar's certificate names, as
    /// `<namespace>/<service account>`.
    pub fn service_account(&self) -> String {
        format!(
            "{}/{}",
            self.metadata.namespace.as_deref().unwrap_or("default"),
            self.spec
                .service_account_name
                .as_deref()
                .filter(|s| !s.is_empty())
                .unwrap_or("default")
        )
    }

    /// Every address of the pod.
    pub fn ips(&self) -> impl Iterator<Item = &str> {
        self.status
            .pod_ip
            .as_deref()
            .into_iter()
            .chain(self.status.pod_ips.iter().map(|p| p.ip.as_str()))
    }
}

/// The PeerAuthentications in force, as the admin port's `/debug/config`
/// lists them.
pub fn view(
    all: &std::collections::BTreeMap<
        super::parse::ObjectKey,
        (std::sync::Arc<PeerAuthentication>, MtlsMode),
    >,
) -> Vec<serde_json::Value> {
    all.iter()
        .map(|(key, (_, mode))| {
            serde_json::json!({
                "namespace": key.namespace,
                "name": key.name,
                "mode": match mode {
                    MtlsMode::MtlsStrict => "STRICT",
                    MtlsMode::MtlsPermissive => "PERMISSIVE",
                    MtlsMode::Unset => "UNSET",
                },
                "meshWide": key.namespace == ROOT_NAMESPACE,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pa(yaml: &str) -> PeerAuthentication {
        serde_saphyr::from_str(yaml).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn modes_and_refusals() {
        let m = |y| pa(y).mode();
        assert_eq!(
            m("metadata: {name: d}\nspec: {mtls: {mode: STRICT}}"),
            Ok(MtlsMode::MtlsStrict)
        );
        assert_eq!(
            m("metadata: {name: d}\nspec: {mtls: {mode: PERMISSIVE}}"),
            Ok(MtlsMode::MtlsPermissive)
        );
        assert_eq!(m("metadata: {name: d}\nspec: {}"), Ok(MtlsMode::Unset));
        let e = m("metadata: {name: d}\nspec: {mtls: {mode: STRIKT}}").err();
        assert_eq!(
            e,
            Some((
                "spec.mtls.mode".into(),
                "\"STRIKT\" is not one of UNSET, PERMISSIVE, STRICT".into()
            ))
        );
        let e = m("metadata: {name: d}\nspec: {selector: {matchLabels: {app: a}}}").err();
        assert_eq!(e.map(|e| e.0), Some("spec.selector".into()));
    }
}
