//! The sweep plot: goodput and p99 time to first token against offered load, as
//! a self-contained SVG (two lines, two y axes). Written by hand: it is one chart,
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
}
