//! AuthorizationPolicy through the real binaries: a backend whose inbound
//! sidecar enforces the policies that select it, called over mutual TLS
//! by `simple-web` (namespace istioinaction) and by an ingress gateway's
//! identity (namespace istio-system), and in plaintext by an unmeshed
//! client; the case, then the cases of Istio's authorization
//! documentation (reference examples, explicit deny, allow-nothing,
//! deny-all, allow-all), each as its callers see it.

use std::time::Duration;

use bytes::Bytes;
use http::Method;

use crate::harness::*;

const BACKEND_TOKEN: &str = "backend-token-0123456789";
const WEB_TOKEN: &str = "web-token-0123456789abcd";
const GATEWAY_TOKEN: &str = "gateway-token-0123456789";

/// Who calls: the web sidecar (.10), the gateway's (.11), or plaintext
/// straight to the backend's inbound listener.
#[derive(Clone, Copy, Debug)]
enum Caller {
    Web,
    Gateway,
    Plain,
}

struct Mesh {
    net: Net,
    _procs: Vec<Proc>,
}

impl Mesh {
    async fn start(octet: u8) -> Mesh {
        let net = Net::new(octet);
        let dir = net.config().parent().expect("dir").to_path_buf();
        let tokens = dir.join("tokens.yaml");
        std::fs::write(
            &tokens,
            format!(
                "tokens:\n- token: {BACKEND_TOKEN}\n  namespace: {NS}\n  serviceAccount: backend\n- token: {WEB_TOKEN}\n  namespace: istioinaction\n  serviceAccount: simple-web\n- token: {GATEWAY_TOKEN}\n  namespace: istio-system\n  serviceAccount: istio-ingressgateway\n"
            ),
        )
        .expect("tokens");
        for (file, token) in [
            ("backend.token", BACKEND_TOKEN),
            ("web.token", WEB_TOKEN),
            ("gateway.token", GATEWAY_TOKEN),
        ] {
            std::fs::write(dir.join(file), token).expect("token");
        }
        net.service("backend", &[1]);
        net.write(
            "pods.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: backend-1\n  namespace: {NS}\n  labels: {{minimesh.io/proxy: sidecar, app: backend}}\nspec:\n  serviceAccountName: backend\nstatus:\n  podIP: \"{}\"\n",
                net.ip(1)
            ),
        );
        let app = net.app(1).await;
        let ca = dir.join("ca");
        let ca_dir = ca.display().to_string();
        let tokens = tokens.display().to_string();
        let cp = net
            .control_plane_with(&["--ca-dir", &ca_dir, "--workload-tokens", &tokens])
            .await;
        let root = ca.join("root-cert.pem").display().to_string();
        let token = |f: &str| dir.join(f).display().to_string();
        let inbound = net.inbound_flags(1);
        let mut flags: Vec<&str> = inbound.iter().map(String::as_str).collect();
        let backend_token = token("backend.token");
        flags.extend([
            "--ca-root",
            &root,
            "--token-file",
            &backend_token,
            "--labels",
            "app=backend,version=v1",
        ]);
        let server = sidecar(&net, 1, NS, &flags).await;
        let web_token = token("web.token");
        let web = sidecar(
            &net,
            10,
            "istioinaction",
            &["--ca-root", &root, "--token-file", &web_token],
        )
        .await;
        let gateway_token = token("gateway.token");
        let gateway = sidecar(
            &net,
            11,
            "istio-system",
            &["--ca-root", &root, "--token-file", &gateway_token],
        )
        .await;
        for caller in [10, 11] {
            wait_sidecar(net.addr(caller, 15000), Duration::from_secs(10), |v| {
                v["clusters"]
                    .as_object()
                    .into_iter()
                    .flat_map(|c| c.values())
                    .flat_map(|c| c["endpoints"].as_array().cloned().unwrap_or_default())
                    .any(|e| e["mtls"] == true)
            })
            .await;
        }
        Mesh {
            net,
            _procs: vec![app, cp, server, web, gateway],
        }
    }

    /// Status and body of one request of `caller`.
    async fn call(&self, caller: Caller, method: Method, path: &str) -> (u16, String) {
        let (addr, host) = match caller {
            Caller::Web => (self.net.addr(10, 15001), "backend.default"),
            Caller::Gateway => (self.net.addr(11, 15001), "backend.default"),
            Caller::Plain => (self.net.addr(1, 9090), "backend"),
        };
        let mut c = Conn::open(addr).await.expect("connect");
        let (status, _, body) = c
            .send(method, host, path, &[], Bytes::new())
            .await
            .expect("answer");
        (status, body)
    }

    /// Writes the policies (`---`-separated documents, "" for none) and
    /// waits until the backend's sidecar enforces exactly `names`
    /// (`namespace/name`).
    async fn policies(&self, yaml: &str, names: &[&str]) {
        self.net.write("authz.yaml", yaml);
        wait_sidecar(self.net.addr(1, 15000), Duration::from_secs(10), |v| {
            let a = &v["authz"];
            let mut listed: Vec<String> = ["deny", "allow"]
                .iter()
                .flat_map(|k| a[k].as_array().cloned().unwrap_or_default())
                .filter_map(|n| n.as_str().map(String::from))
                .collect();
            listed.sort();
            let mut want: Vec<&str> = names.to_vec();
            want.sort();
            a["received"] == true && listed == want
        })
        .await;
    }
}

/// A sidecar at .host in `namespace`, taking its config over TLS, once ready.
async fn sidecar(net: &Net, host: u8, namespace: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "--xds-addr".to_string(),
        format!("https://{}", net.cp_xds()),
        "--workload".into(),
        format!("pod-{host}"),
        "--namespace".into(),
        namespace.into(),
        "--outbound".into(),
        net.addr(host, 15001).to_string(),
        "--admin".into(),
        net.addr(host, 15000).to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let p = net.spawn(&format!("sidecar-{host}"), "sidecar", &args, &[]);
    wait_http(net.addr(host, 15000), "/ready").await;
    p
}

fn policy(name: &str, namespace: &str, spec: &str) -> String {
    format!(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata:\n  name: {name}\n  namespace: {namespace}\nspec:\n{spec}---\n"
    )
}

/// One expectation: who, what, the status.
type Call<'a> = (Caller, Method, &'a str, u16);

/// Each expectation: who, what, the status.
type Expect<'a> = &'a [Call<'a>];

/// A case of Istio's documentation: what it shows, its policies, the
/// names the sidecar then enforces, and what callers see.
type DocCase<'a> = (&'a str, String, Vec<&'a str>, Vec<Call<'a>>);

async fn expect(m: &Mesh, case: &str, cases: Expect<'_>) {
    for (caller, method, path, want) in cases {
        let (status, body) = m.call(*caller, method.clone(), path).await;
        assert_eq!(
            status, *want,
            "{case}: {caller:?} {method} {path}: {status} {body}"
        );
        if status == 403 {
            assert_eq!(body, "RBAC: access denied", "{case}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_policies_allow_and_deny_as_istio_evaluates_them() {
    use Caller::*;
    let m = Mesh::start(144).await;
    let get = || Method::GET;
    let post = || Method::POST;

    // No policy: every caller.
    m.policies("", &[]).await;
    expect(
        &m,
        "no policy",
        &[
            (Web, get(), "/", 200),
            (Gateway, get(), "/", 200),
            (Plain, get(), "/", 200),
        ],
    )
    .await;

    // The issue's: only simple-web may GET the backend.
    let allow_web = policy(
        "allow-web",
        NS,
        "  selector: {matchLabels: {app: backend}}\n  action: ALLOW\n  rules:\n  - from: [{source: {principals: [\"cluster.local/ns/istioinaction/sa/simple-web\"]}}]\n    to: [{operation: {methods: [GET]}}]\n",
    );
    m.policies(&allow_web, &["default/allow-web"]).await;
    expect(
        &m,
        "allow simple-web GET",
        &[
            (Web, get(), "/", 200),
            (Gateway, get(), "/", 403),
            (Web, post(), "/", 403),
            (Plain, get(), "/", 403),
        ],
    )
    .await;
    // A DENY policy overrides the ALLOW.
    let deny_admin = policy(
        "deny-admin",
        NS,
        "  action: DENY\n  rules:\n  - to: [{operation: {paths: [\"/admin*\"]}}]\n",
    );
    m.policies(
        &format!("{allow_web}{deny_admin}"),
        &["default/deny-admin", "default/allow-web"],
    )
    .await;
    expect(
        &m,
        "deny overrides allow",
        &[
            (Web, get(), "/admin/users", 403),
            (Web, get(), "/users", 200),
            // Paths are matched (and sent on) in Istio's normal form:
            // dot segments resolved, unreserved characters decoded.
            (Web, get(), "/users/../admin/users", 403),
            (Web, get(), "/%61dmin", 403),
            (Web, get(), "/users/./%2e%2e/users", 200),
        ],
    )
    .await;
    // Counted by policy, on the backend's sidecar.
    let (_, _, metrics) = get_url(m.net.addr(1, 15000), "/metrics").await;
    assert!(
        metrics.contains(
            "minimesh_authz_denied_total{reason=\"deny\",policy=\"default/deny-admin\"} 3"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("minimesh_authz_denied_total{reason=\"not_allowed\",policy=\"\"} 3"),
        "{metrics}"
    );

    // Istio's documentation, case by case.
    let docs: Vec<DocCase> = vec![
        (
            "allow-nothing: an ALLOW policy with no rule",
            policy("allow-nothing", NS, "  {}\n"),
            vec!["default/allow-nothing"],
            vec![(Web, get(), "/", 403), (Plain, get(), "/", 403)],
        ),
        (
            "deny-all: a DENY policy whose one rule is empty",
            policy("deny-all", NS, "  action: DENY\n  rules:\n  - {}\n"),
            vec!["default/deny-all"],
            vec![(Web, get(), "/", 403), (Gateway, post(), "/x", 403)],
        ),
        (
            "allow-all: an ALLOW policy whose one rule is empty",
            policy("allow-all", NS, "  action: ALLOW\n  rules:\n  - {}\n"),
            vec!["default/allow-all"],
            vec![(Web, get(), "/", 200), (Plain, post(), "/x", 200)],
        ),
        (
            "the reference's example: a principal or a namespace, GET /info* or POST /data",
            policy(
                "httpbin",
                NS,
                "  action: ALLOW\n  rules:\n  - from:\n    - source: {principals: [\"cluster.local/ns/istioinaction/sa/simple-web\"]}\n    - source: {namespaces: [istio-system]}\n    to:\n    - operation: {methods: [GET], paths: [\"/info*\"]}\n    - operation: {methods: [POST], paths: [/data]}\n",
            ),
            vec!["default/httpbin"],
            vec![
                (Web, get(), "/info/x", 200),
                (Gateway, post(), "/data", 200),
                (Gateway, get(), "/data", 403),
                (Web, post(), "/info", 403),
                (Plain, get(), "/info", 403),
            ],
        ),
        (
            "explicit deny: deny-method-get",
            policy(
                "deny-method-get",
                NS,
                "  selector: {matchLabels: {app: backend}}\n  action: DENY\n  rules:\n  - to: [{operation: {methods: [GET]}}]\n",
            ),
            vec!["default/deny-method-get"],
            vec![(Web, get(), "/", 403), (Web, post(), "/", 200)],
        ),
        (
            "deny callers outside a namespace (notNamespaces): plaintext has none",
            policy(
                "deny-others",
                NS,
                "  action: DENY\n  rules:\n  - from: [{source: {notNamespaces: [istioinaction]}}]\n",
            ),
            vec!["default/deny-others"],
            vec![(Web, get(), "/", 200), (Gateway, get(), "/", 403), (Plain, get(), "/", 403)],
        ),
        (
            "a mesh-wide allow-nothing in the root namespace, and this namespace's ALLOW",
            format!(
                "{}{}",
                policy("allow-nothing", "minimesh-system", "  {}\n"),
                policy(
                    "allow-web",
                    NS,
                    "  rules:\n  - from: [{source: {namespaces: [istioinaction]}}]\n",
                )
            ),
            vec!["minimesh-system/allow-nothing", "default/allow-web"],
            vec![(Web, get(), "/", 200), (Gateway, get(), "/", 403)],
        ),
        (
            "a caller past its own sidecar: the inbound normalizes the path it matches",
            policy(
                "deny-admin-only",
                NS,
                "  action: DENY\n  rules:\n  - to: [{operation: {paths: [\"/admin*\"]}}]\n",
            ),
            vec!["default/deny-admin-only"],
            vec![
                (Plain, get(), "/ok/../admin", 403),
                (Plain, get(), "/%61dmin/x", 403),
                (Plain, get(), "/%2e%2e/admin", 403),
                (Plain, get(), "/ok/%2e/", 200),
            ],
        ),
        (
            "a selector the workload's labels do not carry: no effect",
            policy(
                "deny-other-app",
                NS,
                "  selector: {matchLabels: {app: other}}\n  action: DENY\n  rules:\n  - {}\n",
            ),
            vec![],
            vec![(Web, get(), "/", 200), (Plain, get(), "/", 200)],
        ),
        (
            "ports: the app's port",
            policy(
                "ports",
                NS,
                "  rules:\n  - to: [{operation: {ports: [\"8080\"], notPaths: [\"/private*\"]}}]\n",
            ),
            vec!["default/ports"],
            vec![(Web, get(), "/", 200), (Web, get(), "/private/x", 403)],
        ),
    ];
    for (case, yaml, names, cases) in &docs {
        m.policies(yaml, names).await;
        expect(&m, case, cases).await;
    }
}

/// `GET path` of an admin port: status, content type, body.
async fn get_url(addr: std::net::SocketAddr, path: &str) -> (u16, Option<String>, String) {
    get(addr, "localhost", path).await.expect("admin")
}
