//! A Secret made once per cluster and shared by every control-plane
//! replica: the first to start generates it and creates it; a replica that
//! loses the race reads the winner's. The webhook's certificate and the
//! mesh's root CA are kept so.

use std::collections::BTreeMap;

use anyhow::{anyhow, Context};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::Client;
use tracing::info;

/// What a shared Secret holds: key → text.
pub type Data = BTreeMap<String, String>;

/// The data of Secret `namespace/name` (which must hold every one of
/// `keys`), created from `generate()` when the Secret does not exist. Every
/// replica ends with the same data. `what` names it in logs and errors.
pub async fn shared(
    client: &Client,
    namespace: &str,
    name: &str,
    keys: &[&str],
    type_: &str,
    what: &str,
    generate: impl FnOnce() -> anyhow::Result<Data>,
) -> anyhow::Result<Data> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let whole = |s: &Secret| -> Option<Data> {
        let data = s.data.as_ref()?;
        keys.iter()
            .map(|k| {
                let text = String::from_utf8(data.get(*k)?.0.clone()).ok()?;
                Some((k.to_string(), text))
            })
            .collect()
    };
    let missing = || {
        anyhow!(
            "Secret {namespace}/{name} exists but does not hold {} (delete it to have one generated)",
            keys.join(", ")
        )
    };
    if let Some(existing) = api
        .get_opt(name)
        .await
        .with_context(|| format!("reading Secret {namespace}/{name}"))?
    {
        let data = whole(&existing).ok_or_else(missing)?;
        info!(secret = %format!("{namespace}/{name}"), "{what} read from its Secret");
        return Ok(data);
    }
    let data = generate()?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/part-of".to_string(),
                "minimesh".to_string(),
            )])),
            ..Default::default()
        },
        type_: Some(type_.into()),
        data: Some(
            data.iter()
                .map(|(k, v)| (k.clone(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            info!(secret = %format!("{namespace}/{name}"), "{what} generated and stored");
            Ok(data)
        }
        // Another replica stored one first: use that one.
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let winner = api
                .get(name)
                .await
                .with_context(|| format!("reading Secret {namespace}/{name}"))?;
            whole(&winner).ok_or_else(missing)
        }
        Err(e) => Err(e).with_context(|| format!("creating Secret {namespace}/{name}")),
    }
}
