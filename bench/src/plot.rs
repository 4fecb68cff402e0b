//! The harness's pictures, as self-contained SVG: the sweep (goodput and p99
//! time to first token against offered load), an open loop's timeline (each
//! request's time to first token, or its refusal, at its arrival; and the
//! queue over time), and the head-of-line timeline (each stream's token
//! arrivals around a long prefill). Written by hand: three small charts,
//! and a plotting crate would be the largest dependency of the harness.

use std::fmt::Write as _;

/// One sweep point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub offered_rps: f64,
    pub goodput_rps: f64,
    /// `None` when no request got a first token at this load.
    pub ttft_p99_s: Option<f64>,
}

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 80.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const TICKS: usize = 5;

/// A "nice" upper bound for an axis: the next of 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8
/// times a power of ten (each divides into five even ticks).
fn nice_max(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0] {
        if v <= m * p {
            return m * p;
        }
    }
    10.0 * p
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

pub fn sweep_svg(title: &str, points: &[Point]) -> String {
    let x_max = nice_max(points.iter().map(|p| p.offered_rps).fold(0.0, f64::max));
    let g_max = nice_max(points.iter().map(|p| p.goodput_rps).fold(0.0, f64::max));
    let t_max = nice_max(
        points
            .iter()
            .filter_map(|p| p.ttft_p99_s)
            .fold(0.0, f64::max),
    );
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let x = |v: f64| LEFT + v / x_max * pw;
    let yg = |v: f64| TOP + ph - v / g_max * ph;
    let yt = |v: f64| TOP + ph - v / t_max * ph;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    // Axes and grid.
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    for i in 0..=TICKS {
        let f = i as f64 / TICKS as f64;
        let (gx, gy) = (LEFT + f * pw, TOP + ph - f * ph);
        let _ = writeln!(
            s,
            r##"<line x1="{gx}" y1="{TOP}" x2="{gx}" y2="{}" stroke="#eee"/>"##,
            TOP + ph
        );
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{gy}" x2="{}" y2="{gy}" stroke="#eee"/>"##,
            LEFT + pw
        );
        let _ = writeln!(
            s,
            r#"<text x="{gx}" y="{}" text-anchor="middle">{:.2}</text>"#,
            TOP + ph + 18.0,
            f * x_max
        );
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end" fill="#1f77b4">{:.2}</text>"##,
            LEFT - 6.0,
            gy + 4.0,
            f * g_max
        );
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" fill="#d62728">{:.1}</text>"##,
            LEFT + pw + 6.0,
            gy + 4.0,
            f * t_max
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">offered load (requests/s)</text>"#,
        LEFT + pw / 2.0,
        H - 18.0
    );
    let _ = writeln!(
        s,
        r##"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle" fill="#1f77b4">goodput (requests/s within SLO)</text>"##,
        TOP + ph / 2.0
    );
    let _ = writeln!(
        s,
        r##"<text transform="translate({} {}) rotate(90)" text-anchor="middle" fill="#d62728">p99 time to first token (s)</text>"##,
        W - 20.0,
        TOP + ph / 2.0
    );
    // The two series.
    let series = |s: &mut String, color: &str, pts: Vec<(f64, f64)>| {
        let path: Vec<String> = pts.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for (a, b) in pts {
            let _ = writeln!(
                s,
                r#"<circle cx="{a:.1}" cy="{b:.1}" r="3.5" fill="{color}"/>"#
            );
        }
    };
    series(
        &mut s,
        "#1f77b4",
        points
            .iter()
            .map(|p| (x(p.offered_rps), yg(p.goodput_rps)))
            .collect(),
    );
    series(
        &mut s,
        "#d62728",
        points
            .iter()
            .filter_map(|p| p.ttft_p99_s.map(|t| (x(p.offered_rps), yt(t))))
            .collect(),
    );
    let _ = writeln!(s, "</svg>");
    s
}

/// One request of an open loop: when it arrived (s since the run began),
/// whether it completed, and its time to first token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    pub at_s: f64,
    pub completed: bool,
    /// `None`: refused, shed, failed or never answered.
    pub ttft_s: Option<f64>,
}

/// The queue over time: (s since the run began, requests the clients had in
/// flight, the server's `sluice_queue_depth` if it exposes one).
pub type DepthSample = (f64, f64, Option<f64>);

fn svg_head(s: &mut String, w: f64, h: f64, title: &str) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        w / 2.0,
        esc(title)
    );
}

/// A plot area at `top` of height `ph` with a y axis to `y_max` (ticks and
/// grid) and the x grid of `x_max`; its y label on the left.
#[allow(clippy::too_many_arguments)]
fn frame(
    s: &mut String,
    top: f64,
    ph: f64,
    pw: f64,
    x_max: f64,
    y_max: f64,
    y_label: &str,
    x_labels: bool,
) {
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    for i in 0..=TICKS {
        let f = i as f64 / TICKS as f64;
        let (gx, gy) = (LEFT + f * pw, top + ph - f * ph);
        let _ = writeln!(
            s,
            r##"<line x1="{gx}" y1="{top}" x2="{gx}" y2="{}" stroke="#eee"/>"##,
            top + ph
        );
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{gy}" x2="{}" y2="{gy}" stroke="#eee"/>"##,
            LEFT + pw
        );
        if x_labels {
            let _ = writeln!(
                s,
                r#"<text x="{gx}" y="{}" text-anchor="middle">{:.0}</text>"#,
                top + ph + 18.0,
                f * x_max
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            gy + 4.0,
            tick(f * y_max)
        );
    }
    let _ = writeln!(
        s,
        r#"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">{}</text>"#,
        top + ph / 2.0,
        esc(y_label)
    );
}

fn tick(v: f64) -> String {
    if v == 0.0 || v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// An open loop's timeline: above, each request's time to first token at its
/// arrival (completed: a blue dot; refused or failed: a red tick on the
/// axis); below, requests in flight at the clients and the server's queue
/// depth. `phase_ends_s` draws a line where each phase ends.
pub fn timeline_svg(
    title: &str,
    arrivals: &[Arrival],
    depth: &[DepthSample],
    phase_ends_s: &[f64],
) -> String {
    const TW: f64 = 900.0;
    let th = 560.0;
    let pw = TW - LEFT - 30.0;
    let (top1, ph1) = (TOP, 250.0);
    let (top2, ph2) = (TOP + ph1 + 40.0, 160.0);
    let x_max = nice_max(
        arrivals
            .iter()
            .map(|a| a.at_s)
            .chain(depth.iter().map(|d| d.0))
            .chain(phase_ends_s.iter().copied())
            .fold(0.0, f64::max),
    );
    let t_max = nice_max(arrivals.iter().filter_map(|a| a.ttft_s).fold(0.0, f64::max));
    let d_max = nice_max(
        depth
            .iter()
            .map(|d| d.1.max(d.2.unwrap_or(0.0)))
            .fold(0.0, f64::max),
    );
    let x = |v: f64| LEFT + v / x_max * pw;
    let mut s = String::new();
    svg_head(&mut s, TW, th, title);
    frame(
        &mut s,
        top1,
        ph1,
        pw,
        x_max,
        t_max,
        "time to first token (s)",
        false,
    );
    frame(&mut s, top2, ph2, pw, x_max, d_max, "requests", true);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">time since the run began (s)</text>"#,
        LEFT + pw / 2.0,
        th - 14.0
    );
    for &end in phase_ends_s {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{top1}" x2="{0:.1}" y2="{1}" stroke="#999" stroke-dasharray="4 3"/>"##,
            x(end),
            top2 + ph2
        );
    }
    for a in arrivals {
        match (a.completed, a.ttft_s) {
            (true, Some(t)) => {
                let _ = writeln!(
                    s,
                    r##"<circle cx="{:.1}" cy="{:.1}" r="2.2" fill="#1f77b4" fill-opacity="0.7"/>"##,
                    x(a.at_s),
                    top1 + ph1 - t / t_max * ph1
                );
            }
            _ => {
                let _ = writeln!(
                    s,
                    r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#d62728" stroke-width="1.5"/>"##,
                    x(a.at_s),
                    top1 + ph1 - 8.0,
                    top1 + ph1
                );
            }
        }
    }
    let line = |s: &mut String, color: &str, pts: Vec<(f64, f64)>| {
        if pts.len() < 2 {
            return;
        }
        let path: Vec<String> = pts
            .iter()
            .map(|&(t, v)| format!("{:.1},{:.1}", x(t), top2 + ph2 - v / d_max * ph2))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="1.8"/>"#,
            path.join(" ")
        );
    };
    line(
        &mut s,
        "#2ca02c",
        depth.iter().map(|d| (d.0, d.1)).collect(),
    );
    line(
        &mut s,
        "#9467bd",
        depth.iter().filter_map(|d| d.2.map(|q| (d.0, q))).collect(),
    );
    let legend = [
        ("#1f77b4", "first token (completed request)"),
        ("#d62728", "refused / failed (tick at arrival)"),
        ("#2ca02c", "in flight at the clients"),
        ("#9467bd", "server queue depth"),
    ];
    for (i, (color, label)) in legend.iter().enumerate() {
        let lx = LEFT + 10.0 + (i as f64) * 205.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="34" width="10" height="10" fill="{color}"/><text x="{}" y="43">{}</text>"#,
            lx + 14.0,
            esc(label)
        );
    }
    let _ = writeln!(s, "</svg>");
    s
}

/// The head-of-line timeline: one row per stream, a tick at each token's
/// arrival (s since the run began); the long prompt's send and first token
/// as lines across all rows.
pub fn hol_svg(title: &str, streams: &[Vec<f64>], long_sent_s: f64, long_first_s: f64) -> String {
    const HW: f64 = 900.0;
    let row = 34.0;
    let ph = row * streams.len().max(1) as f64;
    let hh = TOP + ph + 80.0;
    let pw = HW - LEFT - 30.0;
    let x_max = nice_max(
        streams
            .iter()
            .flatten()
            .copied()
            .chain([long_first_s])
            .fold(0.0, f64::max),
    );
    let x = |v: f64| LEFT + v / x_max * pw;
    let mut s = String::new();
    svg_head(&mut s, HW, hh, title);
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    for i in 0..=TICKS {
        let f = i as f64 / TICKS as f64;
        let gx = LEFT + f * pw;
        let _ = writeln!(
            s,
            r##"<line x1="{gx}" y1="{TOP}" x2="{gx}" y2="{}" stroke="#eee"/><text x="{gx}" y="{}" text-anchor="middle">{:.0}</text>"##,
            TOP + ph,
            TOP + ph + 18.0,
            f * x_max
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{:.1}" y="{TOP}" width="{:.1}" height="{ph}" fill="#ffbb78" fill-opacity="0.35"/>"##,
        x(long_sent_s),
        (x(long_first_s) - x(long_sent_s)).max(1.0)
    );
    for (i, times) in streams.iter().enumerate() {
        let y = TOP + row * i as f64;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">stream {}</text>"#,
            LEFT - 6.0,
            y + row / 2.0 + 4.0,
            i + 1
        );
        let mut d = String::new();
        for &t in times {
            let _ = write!(d, "M{:.1} {:.1}v{:.1}", x(t), y + 6.0, row - 12.0);
        }
        let _ = writeln!(s, r##"<path d="{d}" stroke="#1f77b4" stroke-width="1"/>"##);
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">time since the streams started (s); shaded: the long prompt, from its send to its first token ({:.1} s)</text>"#,
        LEFT + pw / 2.0,
        hh - 30.0,
        long_first_s - long_sent_s
    );
    let _ = writeln!(s, "</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_axis_bounds() {
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(0.7), 0.8);
        assert_eq!(nice_max(1.3), 1.5);
        assert_eq!(nice_max(2.61), 3.0);
        assert_eq!(nice_max(3.1), 4.0);
        assert_eq!(nice_max(61.0), 80.0);
        assert_eq!(nice_max(85.0), 100.0);
    }

    #[test]
    fn svg_has_both_series_and_escapes_the_title() {
        let pts = [
            Point {
                offered_rps: 0.5,
                goodput_rps: 0.5,
                ttft_p99_s: Some(0.2),
            },
            Point {
                offered_rps: 1.0,
                goodput_rps: 0.9,
                ttft_p99_s: Some(1.5),
            },
            Point {
                offered_rps: 2.0,
                goodput_rps: 0.4,
                ttft_p99_s: None,
            },
        ];
        let svg = sweep_svg("a < b", &pts);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 5);
        assert!(svg.contains("a &lt; b"));
    }

    #[test]
    fn the_timelines_draw_every_request_and_every_token() {
        let arrivals = [
            Arrival {
                at_s: 1.0,
                completed: true,
                ttft_s: Some(0.2),
            },
            Arrival {
                at_s: 2.0,
                completed: false,
                ttft_s: None,
            },
            Arrival {
                at_s: 3.0,
                completed: true,
                ttft_s: Some(1.2),
            },
        ];
        let depth = [
            (0.0, 0.0, Some(0.0)),
            (1.0, 2.0, Some(1.0)),
            (2.0, 3.0, None),
        ];
        let svg = timeline_svg("t & u", &arrivals, &depth, &[1.5]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<circle").count(), 2);
        assert_eq!(svg.matches("stroke=\"#d62728\"").count(), 1);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("t &amp; u"));
        let hol = hol_svg("hol", &[vec![0.1, 0.2, 0.3], vec![0.15]], 0.2, 0.9);
        assert_eq!(hol.matches('M').count() - hol.matches("M ").count(), 4);
        assert!(hol.contains("stream 2"));
    }
}
