//! The HTML page of the report's test recording, as text: self-contained (nothing to
//! fetch), every section there, names escaped, the flame graphs' data readable. The
//! integration test `html` loads a real one in Chromium.
use super::*;
use crate::report::tests::summary;

fn page_of(opts: &ReportOptions) -> String {
    let sites = summary(&ReportOptions { timeline: true, ..opts.clone() });
    let stacks = summary(&ReportOptions { by: GroupBy::Stack, split_processes: true, ..Default::default() });
    page(&sites, stacks, opts).unwrap()
}

/// The flame graphs' data.
fn flame_data(html: &str) -> serde_json::Value {
    let start = html.find("<script type=\"application/json\" id=\"flamegraph-data\">").unwrap();
    let json = &html[start..];
    let json = &json[json.find('>').unwrap() + 1..json.find("</script>").unwrap()];
    serde_json::from_str(json).unwrap()
}

/// A flame graph's SVG, unpacked.
fn svg(f: &serde_json::Value) -> Option<String> {
    f["svgz"].as_str().map(flames::unpacked)
}

#[test]
fn the_page_holds_everything_and_fetches_nothing() {
    let html = page_of(&ReportOptions::default());
    assert!(html.starts_with("<!DOCTYPE html>\n<!-- memtrace report"), "{}", &html[..100]);
    assert!(html.contains("Content-Security-Policy\" content=\"default-src 'none';"));
    for section in ["summary", "memory", "flamegraphs", "sites", "sizes"] {
        assert!(html.contains(&format!("<section id=\"{section}\">")), "{section}");
    }
    // Nothing refers to another resource: the only URLs are SVG namespaces.
    for attr in ["src=", "href=", "url("] {
        for (i, _) in html.match_indices(attr) {
            let rest = &html[i..(i + 60).min(html.len())];
            assert!(!rest.contains("http") && !rest.contains("//"), "{rest}");
        }
    }
    assert!(!html.contains("<link") && !html.contains("@import"));
    // Names are escaped; the chart marks the peak.
    assert!(html.contains("HashMap&lt;K,V,S&gt;::insert") && !html.contains("HashMap<K,V,S>::insert (map.rs"));
    assert!(html.contains("peak 5.0 MiB at 1.5ms"), "the user chart's peak label");
    assert_eq!(html.matches("<figure class=\"chart\"").count(), 2, "user and kernel");
    assert!(html.contains("<td>≤ 128 B</td>"), "the size histogram");
    assert_eq!(html.matches("<button type=\"button\" role=\"tab\" data-view=").count(), 4);

    let data = flame_data(&html);
    for domain in ["user", "kernel"] {
        for view in ["allocs", "bytes", "peak", "leaked"] {
            let f = &data[domain][view];
            let svg = svg(f).unwrap_or_else(|| panic!("{domain} {view}: {f}"));
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{domain} {view}");
            assert!(f["height"].as_u64().unwrap() > 50);
        }
    }
    assert!(svg(&data["user"]["leaked"]).unwrap().contains("parse_request"));
    assert!(svg(&data["kernel"]["peak"]).unwrap().contains("at the kernel peak: 192 B live"));
    // Packed: what the page holds is a fraction of the SVGs.
    let packed: usize =
        ["allocs", "bytes", "peak", "leaked"].iter().map(|v| data["user"][v]["svgz"].as_str().unwrap().len()).sum();
    let plain: usize = ["allocs", "bytes", "peak", "leaked"].iter().map(|v| svg(&data["user"][v]).unwrap().len()).sum();
    assert!(packed * 2 < plain, "{packed} of {plain}");
}

#[test]
fn a_domain_without_stacks_says_so() {
    let opts = ReportOptions {
        filters: crate::grouping::Filters { domain: crate::grouping::DomainFilter::User, ..Default::default() },
        ..Default::default()
    };
    let html = page_of(&opts);
    let data = flame_data(&html);
    assert!(data.get("kernel").is_none() && data["user"]["bytes"]["svgz"].is_string());
    assert!(!html.contains("data-domain=\"kernel\""));
    assert_eq!(escape("a<b & \"c\" 'd'>"), "a&lt;b &amp; &quot;c&quot; &#39;d&#39;&gt;");
}
