//! Memory over time, the peak and the size histograms on the report's test recording: the
//! JSON `timeline`/`peak`/`size_histogram`, `--sort peak`, and the `--timeline` and
//! `--histogram` sections of the text report.
use super::{tests::summary, *};
use crate::{
    analysis::Domain,
    columns::{ColumnChoice, Layout, Width},
};

/// Bytes live at the user peak: 5 × 1 MiB, 10 × 5000, 2 × 100 and the 64 bytes without a
/// stack, at 1.5 ms; the kernel's peak is its first 192-byte block, at 1.4 ms.
const USER_PEAK: u64 = (5 << 20) + 50_000 + 200 + 64;

fn json(opts: &ReportOptions) -> serde_json::Value {
    serde_json::from_str(&render_json(&summary(opts), opts).unwrap()).unwrap()
}

#[test]
fn the_peak_and_the_timeline_are_in_the_json() {
    let j = json(&ReportOptions { timeline: true, ..Default::default() });
    assert_eq!(
        j["peak"]["user"],
        serde_json::json!({"t_ns": 1_500_000, "live_bytes_req": USER_PEAK, "live_allocs": 18, "interval": 0})
    );
    assert_eq!(j["peak"]["kernel"]["t_ns"], 1_400_000);
    assert_eq!(j["totals"]["user"]["peak_live_bytes_req"], USER_PEAK);
    // 2 s of recording in 200 intervals of 10 ms (and the one the end falls in).
    assert_eq!(j["timeline_interval_ns"], 10_000_000);
    let timeline = j["timeline"].as_array().unwrap();
    assert_eq!(timeline.len(), 201);
    assert_eq!(timeline[0]["user_live_bytes"], USER_PEAK);
    assert_eq!(timeline[0]["kernel_live_bytes"], 192);
    assert_eq!(timeline[0]["processes"]["42"], USER_PEAK + 192);
    let end = (1 << 20) + 50_000 + 200 + 64;
    assert_eq!(
        (timeline[1]["t_ns"].as_u64(), timeline[200]["user_live_bytes"].as_u64()),
        (Some(10_000_000), Some(end))
    );
    // Every site's share of its domain's peak adds up to the peak.
    let sites = j["sites"].as_array().unwrap();
    let user: u64 =
        sites.iter().filter(|s| s["domain"] == "user").map(|s| s["live_bytes_req_at_peak"].as_u64().unwrap()).sum();
    assert_eq!(user, USER_PEAK);
    assert_eq!(sites[0]["live_bytes_req_at_peak"], 5 << 20);
    assert_eq!(sites[0]["timeline"].as_array().map(Vec::len), Some(201), "the first sites have their own series");
    assert!(json(&ReportOptions::default())["sites"][0].get("timeline").is_none(), "only with --timeline");
}

#[test]
fn size_histograms_bucket_the_requests() {
    let j = json(&ReportOptions::default());
    let bins = |v: &serde_json::Value| -> Vec<(u64, u64, u64)> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|b| (b["max_size"].as_u64().unwrap(), b["allocs"].as_u64().unwrap(), b["bytes_req"].as_u64().unwrap()))
            .collect()
    };
    assert_eq!(
        bins(&j["totals"]["user"]["size_histogram"]),
        [(64, 1, 64), (128, 100, 10_000), (8192, 10, 50_000), (1 << 20, 5, 5 << 20)]
    );
    assert_eq!(bins(&j["totals"]["kernel"]["size_histogram"]), [(256, 50, 9600)]);
    let pipe = &j["sites"].as_array().unwrap().iter().find(|s| s["domain"] == "kernel").unwrap()["size_histogram"][0];
    assert_eq!((pipe["min_size"].as_u64(), pipe["frag_pct"].as_f64()), (Some(129), Some(25.0)));
}

#[test]
fn sorting_by_peak_puts_the_largest_share_first() {
    let s = summary(&ReportOptions { sort: SortKey::Peak, ..Default::default() });
    let shares: Vec<u64> = s.groups.iter().map(|g| g.stats.live_bytes_req_at_peak).collect();
    assert_eq!(shares, [5 << 20, 50_000, 200, 192, 64]);
    assert_eq!(s.memory.peaks[&Domain::User].live_bytes_req, USER_PEAK);
}

fn text(opts: ReportOptions) -> String {
    render_text(&summary(&opts), &opts)
}

#[test]
fn the_text_report_draws_the_timeline_and_the_histograms() {
    let layout = Layout { width: Width::Columns(100), columns: ColumnChoice::Fit };
    let t = text(ReportOptions { timeline: true, layout: layout.clone(), ..Default::default() });
    let section: Vec<&str> = t.lines().skip_while(|l| !l.starts_with("memory over time")).take(8).collect();
    // 201 intervals of 10 ms, 4 a column: 51 columns.
    assert!(section[0].starts_with("memory over time: 2.0s in 51 columns of 40.0ms"), "{t}");
    assert_eq!(section[2], format!("U    5.0 MiB  █{}  user: peak 5.0 MiB at 1.5ms", "▂".repeat(50)), "{t}");
    assert_eq!(section[3], format!("K      192 B  {}  kernel: peak 192 B at 1.4ms", "█".repeat(51)), "{t}");
    assert!(section[4].ends_with("  app::collections::hash::map::Has…"), "{t}");
    for l in &section {
        assert!(l.chars().count() <= 100, "{l}");
    }
    let h = text(ReportOptions { histogram: true, layout, ..Default::default() });
    let user: Vec<&str> = h.lines().skip_while(|l| *l != "requested sizes, user:").skip(1).take(5).collect();
    assert_eq!(user[0].split_whitespace().collect::<Vec<_>>(), ["SIZE", "ALLOCS", "REQUESTED", "ALLOCATED", "FRAG"]);
    assert!(
        user[2]
            .trim_start()
            .starts_with("≤ 128 B     100    9.8 KiB   10.9 KiB  10.7%  ██████████████████████████████"),
        "{h}"
    );
    assert!(h.contains("\nalloc_pipe_info ← create_pipe_files ← do_pipe2\n    ≤ 256 B: 50 (25.0% frag)\n"), "{h}");
    // By process: a row per domain, counted as rows and named with its domain.
    let h = text(ReportOptions { histogram: true, by: crate::grouping::GroupBy::Process, ..Default::default() });
    let head = h.lines().find(|l| l.starts_with("requested sizes of the first")).unwrap_or_default();
    assert_eq!(head, "requested sizes of the first 2 rows (a process in a domain each):", "{h}");
    assert!(h.lines().any(|l| l.ends_with(", kernel")) && h.lines().any(|l| l.ends_with(", user")), "{h}");
}
