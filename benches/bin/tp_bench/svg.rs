//! A small hand-written SVG chart of the GEMM rows: one panel per dtype, throughput against
//! problem size (FLOPs, log scale), ours beside the reference. No plotting dependency.

use crate::Row;
use std::fmt::Write as _;

const W: f64 = 760.0;
const PANEL_H: f64 = 260.0;
const PAD: f64 = 56.0;

/// FLOPs of a `MxNxK` shape string.
fn flops_of(shape: &str) -> Option<f64> {
    let d: Vec<f64> = shape.split('x').map(|v| v.parse().ok()).collect::<Option<_>>()?;
    (d.len() == 3).then(|| 2.0 * d[0] * d[1] * d[2])
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The chart for `rows` (GEMM rows only), or `None` when there are none.
pub fn chart(rows: &[Row]) -> Option<String> {
    let gemms: Vec<&Row> = rows.iter().filter(|r| r.kind == "gemm" && flops_of(&r.shape).is_some()).collect();
    if gemms.is_empty() {
        return None;
    }
    let mut dtypes: Vec<&str> = gemms.iter().map(|r| r.dtype.as_str()).collect();
    dtypes.dedup();
    dtypes.sort_unstable();
    dtypes.dedup();
    let height = PANEL_H * dtypes.len() as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (p, dtype) in dtypes.iter().enumerate() {
        let top = p as f64 * PANEL_H;
        let mut pts: Vec<(f64, f64, Option<f64>)> = gemms
            .iter()
            .filter(|r| r.dtype == *dtype)
            .filter_map(|r| Some((flops_of(&r.shape)?.log10(), r.ours, r.baseline)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (x0, x1) = (pts.first().map_or(0.0, |p| p.0), pts.last().map_or(1.0, |p| p.0));
        let ymax = pts.iter().flat_map(|p| [p.1, p.2.unwrap_or(0.0)]).fold(0.0, f64::max).max(1e-9) * 1.1;
        let unit = gemms.iter().find(|r| r.dtype == *dtype).map_or("", |r| r.unit);
        let sx = |x: f64| PAD + (x - x0) / (x1 - x0).max(1e-9) * (W - 2.0 * PAD);
        let sy = |y: f64| top + PANEL_H - PAD + -(y / ymax) * (PANEL_H - 1.6 * PAD);
        let _ = writeln!(
            s,
            "<text x=\"{PAD}\" y=\"{}\" font-size=\"13\">{} GEMM: ours (blue) vs reference (orange)</text>",
            top + 18.0,
            esc(dtype)
        );
        let (bx, by) = (PAD, top + PANEL_H - PAD);
        let _ = writeln!(s, "<line x1=\"{bx}\" y1=\"{by}\" x2=\"{}\" y2=\"{by}\" stroke=\"black\"/>", W - PAD);
        let _ = writeln!(s, "<line x1=\"{bx}\" y1=\"{by}\" x2=\"{bx}\" y2=\"{}\" stroke=\"black\"/>", top + 0.6 * PAD);
        let _ =
            writeln!(s, "<text x=\"{}\" y=\"{}\">log10 FLOPs ({x0:.1} .. {x1:.1})</text>", W / 2.0 - 60.0, by + 30.0);
        let _ = writeln!(s, "<text x=\"4\" y=\"{}\">{ymax:.0} {}</text>", top + 0.6 * PAD, esc(unit));
        for (series, color) in [(0usize, "#1f77b4"), (1, "#ff7f0e")] {
            let line: Vec<String> = pts
                .iter()
                .filter_map(|p| if series == 0 { Some((p.0, p.1)) } else { p.2.map(|b| (p.0, b)) })
                .map(|(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                .collect();
            if !line.is_empty() {
                let _ = writeln!(
                    s,
                    "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
                    line.join(" ")
                );
                for pt in &line {
                    let (x, y) = pt.split_once(',').unwrap_or(("0", "0"));
                    let _ = writeln!(s, "<circle cx=\"{x}\" cy=\"{y}\" r=\"2.5\" fill=\"{color}\"/>");
                }
            }
        }
    }
    s.push_str("</svg>\n");
    Some(s)
}
