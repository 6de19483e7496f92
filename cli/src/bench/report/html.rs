//! The self-contained HTML report: inline SVG line charts of every run, with
//! the scenario's events marked; opens offline.

use std::fmt::Write as _;

use super::{EventRecord, RunResult, Second};
use crate::bench::scenario::Scenario;

/// Line colours, one per series: twenty, so that every policy and peer of a
/// shipped scenario has its own in the overview charts.
pub(super) const COLORS: [&str; 20] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
    "#f7b6d2", "#000000", "#dbdb8d", "#9edae5",
];

pub(super) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A line chart of `series` (name, one value per second), with a dashed
/// vertical line at each of `marks` (seconds from the start, label) and the
/// legend below it.
pub(super) fn chart(
    title: &str,
    unit: &str,
    series: &[(String, Vec<f64>)],
    marks: &[(f64, String)],
) -> String {
    let (w, h, pad) = (640.0, 200.0, 40.0);
    let len = series
        .iter()
        .map(|(_, v)| v.len())
        .max()
        .unwrap_or(0)
        .max(2);
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let x = |t: f64| pad + (w - pad) * t / (len - 1) as f64;
    let mut s = format!(
        "<figure><figcaption>{}</figcaption><svg viewBox=\"0 0 {w} {}\" width=\"{w}\" height=\"{}\" role=\"img\">",
        escape(title),
        h + 20.0,
        h + 20.0
    );
    let _ = write!(
        s,
        "<line x1=\"{pad}\" y1=\"{h}\" x2=\"{w}\" y2=\"{h}\" stroke=\"#999\"/><line x1=\"{pad}\" y1=\"0\" x2=\"{pad}\" y2=\"{h}\" stroke=\"#999\"/>\
         <text x=\"2\" y=\"12\" font-size=\"10\">{max:.0}{unit}</text><text x=\"2\" y=\"{h}\" font-size=\"10\">0</text>\
         <text x=\"{}\" y=\"{}\" font-size=\"10\">{}s</text>",
        w - 30.0,
        h + 14.0,
        len - 1
    );
    for (at, label) in marks {
        let mx = x(at.clamp(0.0, (len - 1) as f64));
        let _ = write!(
            s,
            "<line class=\"mark\" x1=\"{mx:.1}\" y1=\"0\" x2=\"{mx:.1}\" y2=\"{h}\" stroke=\"#444\" stroke-dasharray=\"4 3\"/>\
             <text x=\"{:.1}\" y=\"{}\" font-size=\"10\">{}</text>",
            mx + 3.0,
            h - 4.0,
            escape(label)
        );
    }
    let mut legend = String::from("<div class=\"legend\">");
    for (i, (name, v)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<String> = v
            .iter()
            .enumerate()
            .map(|(t, y)| format!("{:.1},{:.1}", x(t as f64), h - h * y / max))
            .collect();
        let _ = write!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"><title>{}</title></polyline>",
            points.join(" "),
            escape(name)
        );
        let _ = write!(
            legend,
            "<span style=\"color:{color}\">&#9632; {}</span> ",
            escape(name)
        );
    }
    s.push_str("</svg>");
    s.push_str(&legend);
    s.push_str("</div></figure>");
    s
}

/// The injected failures of a run as chart marks: "kill s1-50ms-0".
pub(super) fn marks(events: &[EventRecord]) -> Vec<(f64, String)> {
    events
        .iter()
        .map(|e| (e.at_s, format!("{} {}", e.action, e.pod)))
        .collect()
}

/// The HTML report: the table, then per run latency, share and active
/// requests per backend over time. One file, no scripts, opens offline.
pub fn html(scenario: &Scenario, runs: &[RunResult]) -> String {
    let mut s = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>minimesh bench: {0}</title>\
         <style>body{{font-family:sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}th{{background:#f4f4f4}}\
         td:first-child{{text-align:left}}figure{{display:inline-block;margin:0 1em 1em 0}}\
         figcaption{{font-size:13px;font-weight:bold}}section{{border-top:1px solid #ddd;margin-top:1em}}\
         .legend{{font-size:12px;max-width:640px}}.legend span{{white-space:nowrap;margin-right:.6em}}</style>\
         </head><body><h1>minimesh bench: {0}</h1><p>{1}</p>",
        escape(&scenario.name),
        escape(&scenario.description)
    );
    s.push_str("<table><tr><th>policy</th><th>requests</th><th>RPS</th><th>failed</th><th>avg ms</th><th>med</th><th>p90</th><th>p95</th><th>p99</th><th>max</th><th>share per backend %</th><th>peak active per backend</th><th>pick p50 ns</th></tr>");
    for r in runs {
        let l = &r.latency_ms;
        let (share, peak) = r.per_backend();
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{:.1}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&r.policy),
            r.requests,
            r.rps,
            r.errors,
            l.avg,
            l.med,
            l.p90,
            l.p95,
            l.p99,
            l.max,
            share.join(" / "),
            peak.join(" / "),
            r.pick
                .as_ref()
                .map_or("-".into(), |p| format!("&le;{:.0}", p.p50_ns))
        );
    }
    s.push_str("</table>");
    if let Some(r) = runs.first() {
        let pods: Vec<&str> = r.backends.iter().map(|b| b.pod.as_str()).collect();
        let _ = write!(s, "<p>Backends: {}</p>", escape(&pods.join(", ")));
    }
    if runs.len() > 1 {
        // Every run on one chart: the comparison the table cannot show, of
        // when (a kill, the top of a burst) each policy's latency moved.
        let every = |f: &dyn Fn(&Second) -> f64| -> Vec<(String, Vec<f64>)> {
            runs.iter()
                .map(|r| (r.policy.clone(), r.timeline.iter().map(f).collect()))
                .collect()
        };
        let m = runs
            .iter()
            .find(|r| !r.events.is_empty())
            .map_or_else(Vec::new, |r| marks(&r.events));
        s.push_str("<section><h2>Every run</h2>");
        s.push_str(&chart(
            "latency p95 per second",
            "ms",
            &every(&|t| t.p95_ms),
            &m,
        ));
        s.push_str(&chart(
            "requests per second",
            "/s",
            &every(&|t| t.requests as f64),
            &m,
        ));
        if runs.iter().any(|r| r.errors > 0) {
            s.push_str(&chart(
                "errors per second",
                "/s",
                &every(&|t| t.errors as f64),
                &m,
            ));
        }
        s.push_str("</section>");
    }
    for r in runs {
        let _ = write!(s, "<section><h2>{}</h2>", escape(&r.policy));
        if !r.events.is_empty() {
            let ev: Vec<String> = r
                .events
                .iter()
                .map(|e| format!("{} {} at {:.1}s", e.action, e.pod, e.at_s))
                .collect();
            let _ = write!(s, "<p>Events: {}</p>", escape(&ev.join("; ")));
        }
        let m = marks(&r.events);
        s.push_str(&chart(
            "latency p95 per second",
            "ms",
            &[("p95".into(), r.timeline.iter().map(|t| t.p95_ms).collect())],
            &m,
        ));
        s.push_str(&chart(
            "requests and errors per second",
            "/s",
            &[
                (
                    "requests".into(),
                    r.timeline.iter().map(|t| t.requests as f64).collect(),
                ),
                (
                    "errors".into(),
                    r.timeline.iter().map(|t| t.errors as f64).collect(),
                ),
            ],
            &m,
        ));
        let per_backend = |f: &dyn Fn(&Second, usize) -> f64| -> Vec<(String, Vec<f64>)> {
            r.backends
                .iter()
                .enumerate()
                .map(|(i, b)| (b.pod.clone(), r.timeline.iter().map(|t| f(t, i)).collect()))
                .collect()
        };
        s.push_str(&chart(
            "share per backend (requests served per second)",
            "/s",
            &per_backend(&|t, i| t.served.get(i).copied().unwrap_or(0) as f64),
            &m,
        ));
        s.push_str(&chart(
            "active requests (connections) per backend",
            "",
            &per_backend(&|t, i| t.active.get(i).copied().unwrap_or(0) as f64),
            &m,
        ));
        s.push_str("</section>");
    }
    s.push_str("</body></html>\n");
    s
}
