//! `diff` on the report's test recording: compared with itself nothing changed, whatever
//! the grouping; the keys rows are matched by name frames, not addresses.
use super::{
    diff::{DiffFormat, DiffOptions, DiffSort, Status, diff, row_key},
    diff_render::{render_diff_json, render_diff_text, signed_count},
    tests::{recording, summary},
    *,
};
use crate::{columns::Width, grouping::GroupBy};

fn options(by: GroupBy) -> DiffOptions {
    DiffOptions {
        format: DiffFormat::Text,
        by,
        filters: Default::default(),
        sort: DiffSort::Live,
        top: None,
        width: Width::Columns(100),
        alloc_fns: Default::default(),
    }
}

#[test]
fn a_recording_compared_with_itself_has_not_changed() {
    for by in [GroupBy::Site, GroupBy::Stack, GroupBy::Function, GroupBy::Process] {
        let d = diff(recording(), recording(), &options(by)).unwrap();
        assert!(!d.rows.is_empty() && d.rows.iter().all(|r| r.status == Status::Unchanged), "{by:?}");
        let text = render_diff_text(&d, Width::Columns(100));
        assert!(text.starts_with("memtrace diff: old `/usr/bin/app --serve`, 2.0s of events\n"), "{text}");
        assert!(
            text.contains(&format!("0 {} changed ({} unchanged), by growth of live bytes:", by.plural(), d.rows.len())),
            "{text}"
        );
        let json: serde_json::Value = serde_json::from_str(&render_diff_json(&d).unwrap()).unwrap();
        let site = &json["sites"][0];
        assert_eq!((site["status"].as_str(), site["allocs_delta"].as_i64()), (Some("unchanged"), Some(0)), "{site:#}");
        assert_eq!(site["old"]["allocs"], site["new"]["allocs"]);
        assert_eq!(json["totals"]["user"]["live_bytes_req_delta"], 0);
    }
}

#[test]
fn rows_are_matched_by_their_names() {
    let a = summary(&ReportOptions::default());
    let keys: Vec<String> = a.groups.iter().map(|g| row_key(g, GroupBy::Site, &a)).collect();
    assert_eq!(
        keys,
        [
            "user:app::collections::hash::map::HashMap<K,V,S>::insert (map.rs:1105)",
            "user:grow (vec.h:10) [inlined]",
            "kernel:alloc_pipe_info [k]",
            "user:parse_request (app.c:42)",
            "user:[no stack: malloc]",
        ]
    );
    let stacks = summary(&ReportOptions { by: GroupBy::Stack, ..Default::default() });
    let key = row_key(&stacks.groups[0], GroupBy::Stack, &stacks);
    assert_eq!(key, "user:app::collections::hash::map::HashMap<K,V,S>::insert (map.rs:1105);main (app.c:200)");
    assert_eq!([signed_count(0), signed_count(-1234), signed_count(5)], ["0", "-1,234", "+5"]);
}
