//! The Kubernetes source's watches against the fake API server: a relist
//! after 410 Expired, a resume from bookmarks after a dropped connection,
//! and a watch ended at its timeout watched again from where it ended.

use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use crate::fake_kube::FakeKube;
use crate::harness::*;
use crate::kubernetes::{control_plane, rule, service, slice};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_relist_after_410_and_resume_from_bookmarks() {
    let net = Net::new(92);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    // Bookmarks a fifth of a second apart, not a minute: the client's
    // resourceVersion is kept current while the test waits.
    fake.bookmark_every(Duration::from_millis(200));
    let _b: Vec<_> = futures_util::future::join_all((1..=2).map(|h| net.backend(h, &[]))).await;
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true)]));
    fake.apply(rule("backend-dr", "backend", json!({"simple": "RANDOM"})));
    let _cp = control_plane(&net, &fake, "cp-0", 254, &[]).await;
    let _sc = net.sidecar(100, &[]).await;
    let admin = net.addr(100, 15000);
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        policy_of(v, "backend") == "RANDOM"
    })
    .await;
    // No Istio CRD in this cluster: its rules are not watched, and that is no error.
    assert_eq!(fake.count("LIST endpointslices"), 1, "{:#?}", fake.log());

    // A dropped watch after history was compacted: bookmarks kept the
    // client's resourceVersion current, so it resumes without a relist.
    fake.churn_unwatched(50);
    let rv = fake.resource_version();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !fake.bookmarked_at("endpointslices", rv) {
        assert!(
            Instant::now() < deadline,
            "no bookmark at {rv}: {:#?}",
            fake.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fake.drop_watches_and_compact();
    fake.apply(slice(&net, "backend", &[(1, true), (2, true)]));
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        endpoints_of(v, "backend").len() == 2
    })
    .await;
    assert_eq!(
        fake.count("LIST endpointslices"),
        1,
        "resumed from a bookmark, no relist: {:#?}",
        fake.log()
    );
    assert!(fake.count("WATCH endpointslices") >= 2, "{:#?}", fake.log());

    // 410 Gone: every watcher relists, and changes made meanwhile arrive.
    fake.expire();
    fake.apply(rule(
        "backend-dr",
        "backend",
        json!({"simple": "ROUND_ROBIN"}),
    ));
    fake.apply(slice(&net, "backend", &[(2, true)]));
    wait_sidecar(admin, Duration::from_secs(15), |v| {
        policy_of(v, "backend") == "ROUND_ROBIN"
            && endpoints_of(v, "backend") == [net.addr(2, 9090).to_string()]
    })
    .await;
    // Every watcher relists once (each after its own backoff), and only once.
    let deadline = Instant::now() + Duration::from_secs(15);
    for plural in ["destinationrules", "services", "endpointslices"] {
        while fake.count(&format!("LIST {plural}")) < 2 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for plural in ["destinationrules", "services", "endpointslices"] {
        assert_eq!(
            fake.count(&format!("LIST {plural}")),
            2,
            "{plural}: {:#?}",
            fake.log()
        );
    }
    let c = load(net.addr(100, 15001), "backend", 2, 200).await;
    assert_no_failures(&c, "after relist");
    assert_eq!(c.by_endpoint.len(), 1, "{:?}", c.by_endpoint);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_that_time_out_are_watched_again_from_where_they_ended() {
    let net = Net::new(135);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    // Every watch ends within a second, as the real server ends one at its
    // timeoutSeconds (the client's 290 s, scaled down for the test).
    fake.cap_watches(Duration::from_secs(1));
    let _b: Vec<_> = futures_util::future::join_all((1..=2).map(|h| net.backend(h, &[]))).await;
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true)]));
    let _cp = control_plane(&net, &fake, "cp-0", 254, &[]).await;
    let _sc = net.sidecar(100, &[]).await;
    let admin = net.addr(100, 15000);
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        endpoints_of(v, "backend").len() == 1
    })
    .await;
    // Watches end and are made again...
    let deadline = Instant::now() + Duration::from_secs(15);
    while fake.count("WATCH endpointslices") < 3 {
        assert!(Instant::now() < deadline, "{:#?}", fake.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ...so a change still arrives, and none of them needed a new list.
    fake.apply(slice(&net, "backend", &[(1, true), (2, true)]));
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        endpoints_of(v, "backend").len() == 2
    })
    .await;
    assert_eq!(fake.count("LIST endpointslices"), 1, "{:#?}", fake.log());
}
