//! The report on a small recording written here (a user program with a deep stack, a long
//! C++-style name, an inlined frame, a truncated stack, large blocks, kernel allocations
//! made on its behalf, an allocation without a stack and a free without its allocation):
//! what `analyze` adds up, the text at several widths (figures never cut, names
//! ellipsized), `--fields`, stacks, leaks and JSON. `export`'s tests use the same recording.
use std::{path::PathBuf, sync::OnceLock};

use memtrace_common::{Kind, TaskEvent};

use super::*;
use crate::{
    analysis::Domain,
    columns::{ColumnChoice, Layout, NAME_MIN_WIDTH, Width},
    event::{Alloc, Event, Free, Task},
    grouping::{Filters, GroupBy, KindFilter},
    recording::{self, FileFrame, FileStack, Meta, Module, Symbol, SymbolKey, Writer},
};

pub(crate) const PID: u32 = 42;
const K_ALLOC_PIPE: u64 = 0xffff_ffff_8100_0100;
const K_CREATE_PIPE: u64 = 0xffff_ffff_8100_0200;
const K_DO_PIPE2: u64 = 0xffff_ffff_8100_0300;

fn user(offset: u64) -> FileFrame {
    FileFrame::Module { module: 0, offset }
}

fn sym(name: &str, file: &str, line: u32) -> Symbol {
    Symbol { name: name.into(), file: Some(file.into()), line, inlined: false }
}

fn alloc(ts_ns: u64, kind: Kind, ptr: u64, bytes_req: u64, bytes_alloc: u64, stack: u64) -> Event {
    Event::Alloc(Alloc {
        ts_ns,
        pid: PID,
        tid: PID,
        cpu: 0,
        kind,
        flags: 0,
        ptr,
        bytes_req,
        bytes_alloc,
        stack,
        call_site: if kind.is_kernel() { K_ALLOC_PIPE } else { 0 },
        gfp_flags: 0,
        node: -1,
        order: 0,
        allocator: 0,
        cache: 0,
    })
}

fn free(ts_ns: u64, kind: Kind, ptr: u64, cpu: u16) -> Event {
    Event::Free(Free { ts_ns, pid: PID, tid: PID, cpu, kind, flags: 0, ptr, arg: 0 })
}

/// The events, in time order. Stack references are ids + 1.
fn events() -> Vec<Event> {
    let mut timed: Vec<Event> = vec![Event::Task(Task {
        ts_ns: 1_000,
        event: TaskEvent::Exec,
        flags: 0,
        pid: PID,
        tid: PID,
        ppid: 1,
        comm: "app".into(),
        filename: "/usr/bin/app".into(),
    })];
    let t0 = 1_000_000;
    // parse_request: 100 × 100 bytes, 98 freed after 500 ns + 10 ns each.
    for i in 0..100u64 {
        let ts = t0 + i * 1_000;
        timed.push(alloc(ts, Kind::Malloc, 0x5000_0000 + i * 0x80, 100, 112, 1));
        if i < 98 {
            timed.push(free(ts + 500 + i * 10, Kind::Free, 0x5000_0000 + i * 0x80, 0));
        }
    }
    // HashMap insert: 5 × 1 MiB, 4 freed a millisecond later.
    for i in 0..5u64 {
        let ts = t0 + 200_000 + i * 10_000;
        timed.push(alloc(ts, Kind::Malloc, 0x7000_0000 + i * 0x20_0000, 1 << 20, (1 << 20) + 4096, 2));
        if i < 4 {
            timed.push(free(ts + 1_000_000, Kind::Free, 0x7000_0000 + i * 0x20_0000, 0));
        }
    }
    // build_index (truncated stack): 10 × 5000 bytes, never freed.
    for i in 0..10u64 {
        timed.push(alloc(t0 + 300_000 + i * 1_000, Kind::Calloc, 0x6000_0000 + i * 0x2000, 5000, 5008, 3));
    }
    // The kernel, on behalf of main: 50 × 192 bytes (256 allocated), 49 freed, on another CPU
    // every other time.
    for i in 0..50u64 {
        let ts = t0 + 400_000 + i * 1_000;
        timed.push(alloc(ts, Kind::Kmalloc, 0xffff_8880_0000_0000 + i * 0x100, 192, 256, 4));
        if i < 49 {
            timed.push(free(ts + 700, Kind::Kfree, 0xffff_8880_0000_0000 + i * 0x100, (i % 2) as u16));
        }
    }
    timed.push(alloc(t0 + 500_000, Kind::Malloc, 0x9000_0000, 64, 80, 0));
    timed.push(free(t0 + 500_100, Kind::Free, 0xdead_0000, 0));
    // The program exits at 2 s (the session ends with it: `Stats::end_monotonic_ns`, when
    // memtrace stopped, is later).
    timed.push(Event::Task(Task {
        ts_ns: 2_000_000_000,
        event: TaskEvent::Exit,
        flags: memtrace_common::flags::GROUP_DEAD,
        pid: PID,
        tid: PID,
        ppid: 1,
        comm: "app".into(),
        filename: String::new(),
    }));
    timed.sort_by_key(Event::ts_ns);
    timed
}

fn write_recording(path: &std::path::Path) {
    write_recording_as(path, "command", 0);
}

/// The recording, as a session of `mode` begun at `start_monotonic_ns`.
fn write_recording_as(path: &std::path::Path, mode: &str, start_monotonic_ns: u64) {
    let meta = Meta {
        memtrace_version: "test".into(),
        hostname: "testhost".into(),
        kernel_release: "6.1.0-test".into(),
        mode: mode.into(),
        target_pids: vec![PID],
        target_command: vec!["/usr/bin/app".into(), "--serve".into()],
        start_unix_ns: 1_700_000_000_000_000_000,
        start_monotonic_ns,
        page_size: 4096,
        allocator: Some("/usr/lib/libc.so.6".into()),
        allocator_is_glibc: true,
        user: true,
        kernel: true,
        sample_bytes: None,
        call_graph: "dwarf".into(),
        time_resolution_ns: 0,
    };
    let file = std::fs::File::create(path).unwrap();
    let mut w = Writer::new(std::io::BufWriter::new(file), &meta).unwrap();
    w.module(&Module { id: 0, build_id: vec![1; 20], path: "/usr/bin/app".into() });
    let stacks = [
        (vec![], vec![user(0x100), user(0x200), user(0x300), user(0x400)], false),
        (vec![], vec![user(0x500), user(0x400)], false),
        (vec![], vec![user(0x600), user(0x400)], true),
        (vec![K_ALLOC_PIPE, K_CREATE_PIPE, K_DO_PIPE2], vec![user(0x400)], false),
    ];
    for (id, (kernel, user, truncated)) in stacks.into_iter().enumerate() {
        w.stack(&FileStack { id: id as u32, pid: PID, kernel, user, truncated });
    }
    let symbols = [
        (SymbolKey::User(user(0x100)), vec![sym("parse_request", "/src/app.c", 42)]),
        (SymbolKey::User(user(0x200)), vec![sym("serve", "/src/app.c", 90)]),
        (SymbolKey::User(user(0x300)), vec![sym("handle_connection", "/src/app.c", 120)]),
        (SymbolKey::User(user(0x400)), vec![sym("main", "/src/app.c", 200)]),
        (
            SymbolKey::User(user(0x500)),
            vec![sym("app::collections::hash::map::HashMap<K,V,S>::insert", "/src/app/map.rs", 1105)],
        ),
        (
            SymbolKey::User(user(0x600)),
            vec![
                Symbol { name: "grow".into(), file: Some("/src/vec.h".into()), line: 10, inlined: true },
                sym("build_index", "/src/app.c", 300),
            ],
        ),
        (
            SymbolKey::Kernel(K_ALLOC_PIPE),
            vec![Symbol { name: "alloc_pipe_info".into(), file: None, line: 0, inlined: false }],
        ),
        (
            SymbolKey::Kernel(K_CREATE_PIPE),
            vec![Symbol { name: "create_pipe_files".into(), file: None, line: 0, inlined: false }],
        ),
        (SymbolKey::Kernel(K_DO_PIPE2), vec![Symbol { name: "do_pipe2".into(), file: None, line: 0, inlined: false }]),
    ];
    for (key, chain) in symbols {
        w.symbol(key, &chain);
    }
    let events = events();
    for e in &events {
        w.event(e).unwrap();
    }
    let stats = recording::Stats {
        events: events.len() as u64,
        end_monotonic_ns: 2_050_000_000,
        exit_code: Some(0),
        end_reason: "target exited".into(),
        ..Default::default()
    };
    w.finish(&stats).unwrap();
}

/// The recording, written once per test run into the build's directory (always the same
/// bytes: written aside, then renamed over the previous run's).
pub(crate) fn recording() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = PathBuf::from(env!("OUT_DIR"));
        let path = dir.join("report-tests.data");
        let aside = dir.join(format!("report-tests.data.{}", std::process::id()));
        write_recording(&aside);
        std::fs::rename(&aside, &path).unwrap();
        path
    })
}

pub(crate) fn summary(opts: &ReportOptions) -> Summary {
    analyze(recording(), opts).unwrap()
}

fn layout(width: Width) -> Layout<ReportColumn> {
    Layout { width, columns: if width == Width::Unlimited { ColumnChoice::All } else { ColumnChoice::Fit } }
}

fn text(opts: &ReportOptions) -> String {
    render_text(&summary(opts), opts)
}

fn at(width: Width) -> ReportOptions {
    ReportOptions { layout: layout(width), ..Default::default() }
}

#[test]
fn analyze_adds_up_the_recording() {
    let s = summary(&ReportOptions::default());
    assert!(s.finalized, "{:?}", s.warnings);
    // build_index's stack is cut: 10 of the 115 allocations with a stack, past a few percent.
    assert_eq!(s.warnings, s.under_counting);
    assert_eq!(s.under_counting.len(), 1, "{:?}", s.under_counting);
    assert!(
        s.under_counting[0].starts_with("process app [42]: 8.7% of its allocations (10 of 115) have a stack cut short")
    );
    let user = &s.totals[&Domain::User];
    assert_eq!((user.stats.allocs, user.stats.frees, user.unmatched_frees), (116, 102, 1));
    assert_eq!(user.stats.live_allocs, 2 + 1 + 10 + 1);
    let kernel = &s.totals[&Domain::Kernel];
    assert_eq!((kernel.stats.allocs, kernel.stats.frees, kernel.stats.bytes_alloc), (50, 49, 50 * 256));
    assert_eq!(kernel.stats.freed_on_other_cpu, 24);
    let labels: Vec<&str> = s.groups.iter().map(|g| g.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "app::collections::hash::map::HashMap<K,V,S>::insert (map.rs:1105) ← main (app.c:200)",
            "grow (vec.h:10) [inlined] ← build_index (app.c:300) ← main (app.c:200)",
            "alloc_pipe_info ← create_pipe_files ← do_pipe2",
            "parse_request (app.c:42) ← serve (app.c:90) ← handle_connection (app.c:120) ← …",
            "[no stack: malloc]",
        ],
        "sorted by bytes allocated"
    );
    assert!(s.groups[1].truncated && !s.groups[0].truncated);
    assert_eq!(
        s.coverage[&Domain::User],
        StackCoverage { allocs_with_stack: 115, allocs_truncated: 10, stacks_truncated: 1, ..Default::default() }
    );
    assert_eq!(s.comms[&PID], "app");
}

#[test]
fn filters_select_what_counts() {
    let opts = ReportOptions {
        filters: Filters { domain: crate::grouping::DomainFilter::User, min_size: Some(1000), ..Default::default() },
        ..Default::default()
    };
    let s = summary(&opts);
    assert_eq!(s.groups.len(), 2, "the large blocks only");
    assert!(s.groups.iter().all(|g| g.domain == Domain::User && g.stats.bytes_req >= 1000 * g.stats.allocs));
    let opts = ReportOptions {
        filters: Filters { kinds: vec![KindFilter::Kmalloc], ..Default::default() },
        ..Default::default()
    };
    assert_eq!(summary(&opts).groups.len(), 1);
    let opts =
        ReportOptions { filters: Filters { comm: Some("other".into()), ..Default::default() }, ..Default::default() };
    assert!(summary(&opts).groups.is_empty());
}

/// A filter that names what the recording has none of is a mistake said in one line with
/// what it has; one that exists but keeps nothing is an empty report.
#[test]
fn filters_naming_nothing_recorded_fail_with_what_there_is() {
    let path = Path::new("x.data");
    let check = |filters: Filters| {
        let s = summary(&ReportOptions { filters: filters.clone(), ..Default::default() });
        super::check_filters(&s, &filters, path).map_err(|e| e.to_string())
    };
    let err = check(Filters { comm: Some("nosuch".into()), ..Default::default() }).unwrap_err();
    assert!(err.starts_with("no process named nosuch in x.data: it has app [42] ("), "{err}");
    assert!(err.ends_with(" allocations)"), "{err}");
    let err = check(Filters { pid: Some(7), ..Default::default() }).unwrap_err();
    assert!(err.starts_with("pid 7 is not in x.data: it has app [42] ("), "{err}");
    let err = check(Filters { allocator: Some("nosuch".into()), ..Default::default() }).unwrap_err();
    assert!(err.starts_with("no allocator nosuch in x.data: it has ") && err.ends_with("unknown"), "{err}");
    // There, but nothing kept: no error.
    assert_eq!(check(Filters { comm: Some("app".into()), min_size: Some(1 << 40), ..Default::default() }), Ok(()));
    assert_eq!(check(Filters { allocator: Some("unknown".into()), ..Default::default() }), Ok(()));
    assert_eq!(check(Filters { pid: Some(PID), ..Default::default() }), Ok(()));
    // A process with allocations but no name (it exited before it could be read).
    let filters = Filters { pid: Some(PID), min_size: Some(1 << 40), ..Default::default() };
    let mut nameless = summary(&ReportOptions { filters: filters.clone(), ..Default::default() });
    nameless.comms.clear();
    nameless.meta.target_pids.clear();
    assert!(super::check_filters(&nameless, &filters, path).is_ok());
    // A name the kernel cut to 15 characters: the cut one is suggested.
    let mut s = summary(&ReportOptions::default());
    s.comms.insert(PID, "a_long_program_".into());
    let filters = Filters { comm: Some("a_long_program_name".into()), ..Default::default() };
    let mut s2 = summary(&ReportOptions { filters: filters.clone(), ..Default::default() });
    s2.comms = s.comms.clone();
    let err = super::check_filters(&s2, &filters, path).unwrap_err().to_string();
    assert!(err.ends_with("(the kernel keeps a name's first 15 characters: --comm a_long_program_)"), "{err}");
}

/// The summary's stack line counts the allocations the filters keep, and a report that
/// keeps none says so instead of printing tables of headers alone.
#[test]
fn the_summary_counts_what_the_filters_keep() {
    let large = ReportOptions { filters: Filters { min_size: Some(1000), ..Default::default() }, ..Default::default() };
    let s = summary(&large);
    let user = s.coverage[&Domain::User];
    assert_eq!(
        user.allocs_with_stack,
        s.groups.iter().filter(|g| g.domain == Domain::User).map(|g| g.stats.allocs).sum::<u64>()
    );
    assert!(user.allocs_with_stack < summary(&ReportOptions::default()).coverage[&Domain::User].allocs_with_stack);
    let kernel_only = ReportOptions {
        filters: Filters { kinds: vec![KindFilter::Kmalloc], ..Default::default() },
        ..Default::default()
    };
    assert!(summary(&kernel_only).coverage.get(&Domain::User).is_none_or(|c| c.allocs_with_stack == 0));

    let none = ReportOptions {
        filters: Filters { comm: Some("other".into()), ..Default::default() },
        layout: layout(Width::Columns(100)),
        ..Default::default()
    };
    let t = text(&none);
    assert!(t.contains("\nno allocation matches the filters\n") && t.ends_with("\n0 call sites\n"), "{t}");
    assert!(!t.contains("ALLOCS"), "{t}");
    // A domain the recording has none of: allocations were recorded, not of it.
    let gpu = ReportOptions {
        filters: Filters { domain: crate::grouping::DomainFilter::Gpu, ..Default::default() },
        layout: layout(Width::Columns(100)),
        ..Default::default()
    };
    let t = text(&gpu);
    assert!(t.contains("\nno allocation matches the filters\n"), "{t}");
}

#[test]
fn a_wide_report_shows_every_column_and_whole_names() {
    let text = text(&at(Width::Unlimited));
    let header = text.lines().find(|l| l.contains("SITE")).unwrap();
    for c in ReportColumn::ALL {
        assert!(header.contains(c.header()), "{header}");
    }
    assert!(text.contains("HashMap<K,V,S>::insert (map.rs:1105) ← main (app.c:200)\n"), "{text}");
    insta::assert_snapshot!("report_wide", text);
}

/// The lines of the groups table (header first), and of the totals table.
fn tables(text: &str) -> (Vec<&str>, Vec<&str>) {
    let lines: Vec<&str> = text.lines().collect();
    let groups_at = lines.iter().position(|l| l.ends_with("SITE")).unwrap();
    let totals_at = lines.iter().position(|l| l.contains("ALLOCS") && !l.ends_with("SITE")).unwrap();
    let totals_end = lines[totals_at..].iter().position(|l| l.starts_with("lost events")).unwrap() + totals_at;
    (lines[groups_at..].to_vec(), lines[totals_at..totals_end].to_vec())
}

/// The cells of a table line: runs separated by two spaces or more.
fn cells(line: &str) -> Vec<&str> {
    line.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect()
}

#[test]
fn reports_fit_80_120_and_200_columns_without_cutting_figures() {
    let wide = text(&at(Width::Unlimited));
    let (wide_groups, wide_totals) = tables(&wide);
    for width in [80, 120, 200] {
        let text = text(&at(Width::Columns(width)));
        let (groups, totals) = tables(&text);
        for l in groups.iter().chain(&totals) {
            assert!(l.chars().count() <= width, "{width}: {l:?}\n{text}");
        }
        // Every figure shown is the row's figure, whole (the name is the last cell).
        for (narrow, wide) in groups.iter().zip(&wide_groups).skip(1) {
            let narrow = cells(narrow);
            let wide = cells(wide);
            for c in &narrow[..narrow.len() - 1] {
                assert!(wide.contains(c), "{width}: {c:?} not in {wide:?}");
            }
            let name = narrow[narrow.len() - 1];
            assert!(name.chars().count() >= NAME_MIN_WIDTH.min(wide[wide.len() - 1].chars().count()), "{name:?}");
        }
        for (narrow, wide) in totals.iter().zip(&wide_totals) {
            for c in cells(narrow) {
                assert!(cells(wide).contains(&c), "{width}: {c:?} not in {wide:?}");
            }
        }
        // Headers are whole, and the column sorted by stays.
        let header = groups[0];
        assert!(header.contains("ALLOCATED"), "{header}");
        let known: Vec<&str> = ReportColumn::ALL.iter().map(|c| c.header()).collect();
        for h in cells(header) {
            assert!(known.contains(&h) || h == "SITE", "{width}: header {h:?} cut in {header:?}");
        }
    }
    insta::assert_snapshot!("report_80", text(&at(Width::Columns(80))));
    insta::assert_snapshot!("report_120", text(&at(Width::Columns(120))));
    insta::assert_snapshot!("report_200", text(&at(Width::Columns(200))));
}

#[test]
fn listed_fields_are_the_columns() {
    let opts = ReportOptions {
        layout: Layout {
            width: Width::Columns(60),
            columns: ColumnChoice::Listed(vec![ReportColumn::Live, ReportColumn::Allocs]),
        },
        ..Default::default()
    };
    let text = text(&opts);
    let (groups, _) = tables(&text);
    assert_eq!(
        groups,
        [
            "   LIVE BYTES  ALLOCS  SITE",
            "U     1.0 MiB       5  app::collections::hash::map::HashMap…",
            "U    48.8 KiB      10  grow (vec.h:10) [inlined] ← build_in…",
            "K       192 B      50  alloc_pipe_info ← create_pipe_files …",
            "U       200 B     100  parse_request (app.c:42) ← serve (ap…",
            "U        64 B       1  [no stack: malloc]",
        ]
    );
}

#[test]
fn stacks_follow_their_rows_and_names_fit() {
    let opts =
        ReportOptions { by: GroupBy::Stack, top: Some(2), layout: layout(Width::Columns(80)), ..Default::default() };
    let text = text(&opts);
    let rows: Vec<&str> = text.lines().skip_while(|l| !l.ends_with("STACK")).collect();
    assert!(
        rows[1].ends_with("app::collections::hash::map::HashMap<K,V,S>::insert (map.rs:1105)")
            || rows[1].ends_with("…"),
        "{text}"
    );
    assert_eq!(rows[2], "      main (app.c:200)", "{text}");
    assert!(rows[3].ends_with("grow (vec.h:10) [inlined]"), "{text}");
    assert_eq!(&rows[4..], ["      build_index (app.c:300)", "      main (app.c:200)"], "{text}");
}

#[test]
fn functions_and_processes_name_their_rows() {
    let opts = ReportOptions { by: GroupBy::Function, layout: layout(Width::Unlimited), ..Default::default() };
    let text = text(&opts);
    assert!(text.contains("5 functions, sorted by bytes allocated:"), "{text}");
    assert!(text.lines().any(|l| l.ends_with("  FUNCTION")), "{text}");
    assert!(text.lines().any(|l| l.ends_with("  parse_request")), "{text}");
    let opts = ReportOptions { by: GroupBy::Process, layout: layout(Width::Columns(80)), ..Default::default() };
    let s = summary(&opts);
    assert_eq!(s.groups.iter().map(|g| g.label.as_str()).collect::<Vec<_>>(), ["app [42]", "app [42]"]);
    let json: serde_json::Value = serde_json::from_str(&render_json(&s, &opts).unwrap()).unwrap();
    assert_eq!(json["sites"][0]["process"], "app [42]");
    // `--top` counts processes, each with all its rows, as the header does.
    let opts = ReportOptions { top: Some(1), ..opts };
    assert_eq!(summary(&opts).groups.len(), 2);
    let top = self::text(&opts);
    assert!(top.contains("1 process, sorted by"), "{top}");
}

#[test]
fn leaks_list_the_blocks_still_live() {
    let opts = ReportOptions { leaks: true, layout: layout(Width::Columns(80)), ..Default::default() };
    let text = text(&opts);
    let leaks = text.split_once("still live at the end").unwrap().1;
    insta::assert_snapshot!("report_leaks", leaks);
    let opts = ReportOptions { leaks: true, older_than: Some(std::time::Duration::from_micros(1_998_600)), ..opts };
    let s = summary(&opts);
    assert_eq!(
        s.leaks.iter().map(|l| l.blocks).sum::<u64>(),
        2 + 1 + 10,
        "the kernel block and the late ones are younger"
    );
    let older = self::text(&opts);
    assert!(
        older.contains("13 blocks") && older.contains("still live at the end, allocated over 2.0s before it"),
        "{older}"
    );
}

#[test]
fn json_carries_every_figure() {
    let opts = ReportOptions { format: Format::Json, ..Default::default() };
    let s = summary(&opts);
    let json: serde_json::Value = serde_json::from_str(&render(&s, &opts).unwrap()).unwrap();
    assert_eq!(json["totals"]["user"]["allocs"], 116);
    assert_eq!(json["totals"]["user"]["unmatched_frees"], 1);
    assert_eq!(json["totals"]["kernel"]["freed_on_other_cpu"], 24);
    assert_eq!(json["sites"].as_array().unwrap().len(), 5);
    assert_eq!(json["sites"][0]["frames"][0]["function"], "app::collections::hash::map::HashMap<K,V,S>::insert");
    assert_eq!(json["sites"][1]["truncated"], true);
    assert_eq!(json["sites"][1]["kinds"], serde_json::json!(["calloc"]));
    assert_eq!(json["stacks"]["user"]["allocs_truncated"], 10);
    assert_eq!(json["group_by"], "site");
    assert_eq!(json["exit_code"], 0);
    assert!(json["leaks"].is_null());
    assert!(json.get("process").is_none() && json["sites"][0].get("process").is_none());
}

#[test]
fn headers_say_what_rows_are_and_what_they_are_sorted_by() {
    let by = |by: GroupBy, sort: SortKey| {
        text(&ReportOptions { by, sort, layout: layout(Width::Columns(120)), ..Default::default() })
    };
    let text = by(GroupBy::Process, SortKey::Allocs);
    // One process, with a row for its user and one for its kernel allocations.
    assert!(text.contains("\n1 process, sorted by allocations:\n"), "{text}");
    assert!(text.lines().any(|l| l.ends_with("  PROCESS")), "{text}");
    let text = by(GroupBy::Site, SortKey::Live);
    assert!(text.contains("\n5 call sites, sorted by live bytes:\n"), "{text}");
    // With --top, how many there are in all.
    let top =
        super::tests::text(&ReportOptions { top: Some(2), layout: layout(Width::Columns(120)), ..Default::default() });
    assert!(top.contains("\nthe first 2 of 5 call sites, sorted by bytes allocated:\n"), "{top}");
    let one = text_of_one_row();
    assert!(one.contains("\n1 function, sorted by bytes allocated:\n"), "{one}");
    // The kernel line says what was cut (the user part) but describes no user walk.
    let text = by(GroupBy::Site, SortKey::Alloc);
    let kernel = text.lines().find(|l| l.starts_with("kernel stacks:")).unwrap();
    assert_eq!(kernel, "kernel stacks: 0 of 50 allocations cut short in user space (0.0%, 0 distinct stacks)");
}

fn text_of_one_row() -> String {
    text(&ReportOptions {
        by: GroupBy::Function,
        filters: Filters { kinds: vec![KindFilter::Kmalloc], ..Default::default() },
        ..Default::default()
    })
}

#[test]
fn leaks_are_largest_first_and_top_keeps_the_totals() {
    let leaks =
        |sort: SortKey, top: Option<usize>| summary(&ReportOptions { leaks: true, sort, top, ..Default::default() });
    let s = leaks(SortKey::default(), None);
    let bytes: Vec<u64> = s.leaks.iter().map(|l| l.bytes_alloc).collect();
    assert!(bytes.windows(2).all(|w| w[0] >= w[1]), "largest first by default: {bytes:?}");
    assert_eq!(
        s.leak_totals,
        LeakTotals { blocks: 15, bytes_req: (1 << 20) + 200 + 50_000 + 192 + 64, stacks: 5, ..Default::default() }
    );
    let s = leaks(SortKey::LiveAllocs, None);
    assert_eq!(s.leaks[0].blocks, 10, "--sort live-allocs: most blocks first");
    let s = leaks(SortKey::Live, Some(1));
    assert_eq!(s.leaks.len(), 1);
    assert_eq!(s.leaks[0].bytes_req, 1 << 20, "--sort live: most live bytes first");
    assert_eq!(s.leak_totals.blocks, 15, "--top does not change the totals");
    let opts = ReportOptions { leaks: true, top: Some(1), layout: layout(Width::Columns(80)), ..Default::default() };
    let text = text(&opts);
    assert!(
        text.contains(
            "15 blocks (1.0 MiB) still live at the end, from 5 stacks, sorted by bytes allocated; the first 1:"
        ),
        "{text}"
    );
    assert!(text.contains("\n1 block, 1.0 MiB requested"), "{text}");
}

#[test]
fn json_addresses_are_hex_strings() {
    let opts = ReportOptions { format: Format::Json, ..Default::default() };
    let json: serde_json::Value = serde_json::from_str(&render(&summary(&opts), &opts).unwrap()).unwrap();
    let kernel = json["sites"].as_array().unwrap().iter().find(|s| s["domain"] == "kernel").unwrap();
    assert_eq!(kernel["frames"][0]["address"], "0xffffffff81000100");
    assert_eq!(json["sites"][0]["frames"][0]["address"], "0x500");
    assert_eq!(json["totals"]["reserved"]["allocs"], 0, "reserved figures are there wherever user ones are");
}

/// `record`'s end-of-run warnings (`warnings::of_recording_so_far`, which reads the stacks'
/// cuts but not their frames, from the file `record` is finishing, with the stats it will
/// write) say what the report says, on recordings of several processes:
/// one forked during the recording whose frees mostly had no allocation, one attached
/// mid-run, one whose stacks are cut (one stack defined again, whole, after its events), a
/// thread whose unmatched frees come before its next allocation and one whose frees are
/// the allocator's at thread exit, and a command that allocated nothing in user space.
#[test]
fn record_end_warnings_say_what_the_report_says() {
    let meta = |mode: &str, user: bool| Meta {
        memtrace_version: "test".into(),
        mode: mode.into(),
        target_pids: vec![10],
        target_command: vec!["/usr/bin/app".into()],
        user,
        kernel: true,
        call_graph: "dwarf".into(),
        ..Default::default()
    };
    let alloc = |ts: u64, pid: u32, tid: u32, ptr: u64, stack: u64| {
        Event::Alloc(Alloc {
            ts_ns: ts,
            pid,
            tid,
            cpu: 0,
            kind: Kind::Malloc,
            flags: 0,
            ptr,
            bytes_req: 32,
            bytes_alloc: 32,
            stack,
            call_site: 0,
            gfp_flags: 0,
            node: -1,
            order: 0,
            allocator: 1,
            cache: 0,
        })
    };
    let free = |ts: u64, pid: u32, tid: u32, ptr: u64| {
        Event::Free(Free { ts_ns: ts, pid, tid, cpu: 0, kind: Kind::Free, flags: 0, ptr, arg: 0 })
    };
    let task = |ts: u64, event: TaskEvent, pid: u32, comm: &str| {
        Event::Task(Task {
            ts_ns: ts,
            event,
            flags: 0,
            pid,
            tid: pid,
            ppid: 10,
            comm: comm.into(),
            filename: String::new(),
        })
    };
    let tmp = tempfile::Builder::new().prefix("memtrace-end-warnings-").tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    // Stats the warnings read too (kernel stacks caught differing from an unwind).
    let stats = recording::Stats { kernel_stacks_checked: 10, kernel_stacks_differed: 3, ..Default::default() };
    let write = |name: &str, meta: &Meta, events: &[Event], stacks: &[FileStack]| {
        let path = dir.join(name);
        let mut w = Writer::new(std::io::BufWriter::new(std::fs::File::create(&path).unwrap()), meta).unwrap();
        for (i, e) in events.iter().enumerate() {
            // Stacks are defined halfway: the later ones after events that refer to them.
            if i == events.len() / 2 {
                stacks.iter().for_each(|s| w.stack(s));
                w.flush().unwrap();
            }
            w.event(e).unwrap();
        }
        // As `record` ends: every event and stack flushed, the warnings read from there
        // while the frames' names are written after them.
        w.flush().unwrap();
        let len = w.bytes_written();
        w.symbol(SymbolKey::Kernel(0xffff_0000), &[]);
        w.flush().unwrap();
        w.finish(&stats).unwrap();
        (path, len)
    };
    const FAR_ID: u64 = 1 << 27;
    let stack = |id: u32, pid: u32, truncated: bool| FileStack {
        id,
        pid,
        kernel: vec![],
        user: vec![user(0x100 + u64::from(id)), user(0x400)],
        truncated,
    };
    let mut events = vec![task(1, TaskEvent::Exec, 10, "app"), task(2, TaskEvent::Fork, 11, "worker")];
    let mut ts = 10;
    for i in 0..60u64 {
        ts += 10;
        // pid 10: stacks 1 and 2 (ids 0 and 1), the second cut.
        events.push(alloc(ts, 10, 10, 0x1000 + i * 64, 1 + i % 2));
        events.push(free(ts + 1, 10, 10, 0x1000 + i * 64));
        // pid 11 (forked): half its frees are of blocks never seen, then it allocates again.
        events.push(alloc(ts + 2, 11, 11, 0x9000 + i * 64, 3));
        events.push(free(ts + 3, 11, 11, if i % 2 == 0 { 0x9000 + i * 64 } else { 0x7_0000 + i }));
        // pid 12 (attached mid-run): a thread freeing blocks allocated before tracing began.
        events.push(free(ts + 4, 12, 13, 0x5_0000 + i));
        events.push(alloc(ts + 5, 12, 13, 0x6_0000 + i * 64, 4));
        // A stack id far past the others (a damaged or hand-made file): tallied all the same.
        events.push(alloc(ts + 6, 12, 13, 0xa_0000 + i * 64, FAR_ID + 1));
    }
    // pid 12's other thread frees unknown blocks and never allocates again (the allocator's
    // cache at thread exit).
    for i in 0..30u64 {
        events.push(free(ts + 100 + i, 12, 14, 0x8_0000 + i));
    }
    events.push(task(ts + 200, TaskEvent::Exit, 11, "worker"));
    // Stack 2 (id 1) first whole, defined again cut: the later definition holds.
    let stacks = [
        stack(0, 10, false),
        stack(1, 10, false),
        stack(2, 11, false),
        stack(3, 12, true),
        stack(1, 10, true),
        stack(FAR_ID as u32, 12, true),
    ];
    let (many, len) = write("many.data", &meta("command", true), &events, &stacks);
    let report = analyze(&many, &ReportOptions { top: Some(0), ..Default::default() }).unwrap();
    assert!(report.under_counting.len() >= 3, "{:?}", report.under_counting);
    assert_eq!(super::warnings::of_recording_so_far(&many, len, &stats), report.under_counting);
    // A command that allocated nothing in user space.
    let kernel_only = [task(1, TaskEvent::Exec, 10, "app")];
    let (none, len) = write("none.data", &meta("command", true), &kernel_only, &[]);
    let report = analyze(&none, &ReportOptions::default()).unwrap();
    // Nothing seen, and the kernel stacks' line.
    assert_eq!(report.under_counting.len(), 2, "{:?}", report.under_counting);
    assert_eq!(super::warnings::of_recording_so_far(&none, len, &stats), report.under_counting);
}

/// The text and JSON reports name rows the analysis left unnamed as they write them (a
/// report by stack of a deep Python recording held every whole stack at once: 1.4 GB of
/// text, 12.5 GB as JSON values), and write the same bytes as from named rows.
#[test]
fn unnamed_rows_report_as_named_ones() {
    for by in [GroupBy::Stack, GroupBy::Site, GroupBy::Function, GroupBy::Process] {
        for leaks in [false, true] {
            let named = ReportOptions { by, leaks, layout: layout(Width::Unlimited), ..Default::default() };
            let unnamed = ReportOptions { rows_unnamed: true, ..named.clone() };
            let (a, b) = (summary(&named), summary(&unnamed));
            assert!(b.groups.iter().all(|r| r.frames.is_empty()));
            assert_eq!(render_text(&a, &named), render_text(&b, &unnamed), "{by:?}, leaks {leaks}");
            assert_eq!(render_json(&a, &named).unwrap(), render_json(&b, &unnamed).unwrap(), "{by:?}, leaks {leaks}");
            // Written out as it is made: the same bytes.
            let mut streamed = Vec::new();
            write_text(&b, &unnamed, &mut streamed).unwrap();
            assert_eq!(String::from_utf8(streamed).unwrap(), render_text(&a, &named));
        }
    }
}

/// A session of the whole machine (or of running processes) lasts from its start, not from
/// its first event: `record -a -d 4s --no-kernel` saw its first allocation 2.4 s in and
/// read "1.6s of events" (helper-44). A command's recording spans its events, to its exit.
#[test]
fn a_machine_wide_session_lasts_from_its_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("all.data");
    write_recording_as(&path, "all", 500);
    let all = analyze(&path, &ReportOptions::default()).unwrap();
    // Until memtrace stopped: the machine's processes go on.
    assert_eq!(all.duration_ns, 2_050_000_000 - 500);
    let command = analyze(recording(), &ReportOptions::default()).unwrap();
    let first = events().first().map(Event::ts_ns).unwrap();
    assert!(first > 500, "{first}");
    // Until its exit, not until memtrace had drained and detached (helper-49: a block
    // allocated 0.1 ms before a program's exit read 95.8 ms old).
    assert_eq!(command.duration_ns, 2_000_000_000 - first);
}

/// By process, a process's rows (one per domain) stay together, where its first ranks:
/// sorted by bytes alone, one process's kernel row came between another's two rows.
#[test]
fn a_process_keeps_its_rows_together() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("two.data");
    let meta =
        Meta { memtrace_version: "test".into(), mode: "all".into(), user: true, kernel: true, ..Default::default() };
    let mut w = Writer::new(std::io::BufWriter::new(std::fs::File::create(&path).unwrap()), &meta).unwrap();
    let on = |pid: u32, e: Event| match e {
        Event::Alloc(a) => Event::Alloc(Alloc { pid, tid: pid, ..a }),
        other => other,
    };
    // pid 1: user 1000 B, kernel 10 B; pid 2: kernel 600 B, user 500 B.
    let events = [
        on(1, alloc(1_000, Kind::Malloc, 0x1000, 1000, 1000, 0)),
        on(1, alloc(2_000, Kind::Kmalloc, 0xffff_8880_0000_0000, 10, 10, 0)),
        on(2, alloc(3_000, Kind::Kmalloc, 0xffff_8880_0000_1000, 600, 600, 0)),
        on(2, alloc(4_000, Kind::Malloc, 0x2000, 500, 500, 0)),
    ];
    for e in &events {
        w.event(e).unwrap();
    }
    w.finish(&recording::Stats { events: 4, ..Default::default() }).unwrap();
    let opts = ReportOptions { by: GroupBy::Process, ..Default::default() };
    let rows: Vec<(u32, Domain)> =
        analyze(&path, &opts).unwrap().groups.iter().map(|r| (r.pids[0], r.domain)).collect();
    assert_eq!(rows, [(1, Domain::User), (1, Domain::Kernel), (2, Domain::Kernel), (2, Domain::User)]);
}

#[test]
fn a_command_is_shown_as_a_shell_reads_it_back() {
    use super::text::shell_word;
    assert_eq!(shell_word("/usr/bin/app"), "/usr/bin/app");
    assert_eq!(shell_word("--size=4k"), "--size=4k");
    assert_eq!(shell_word("trap \"\" INT; sleep 6"), "'trap \"\" INT; sleep 6'");
    assert_eq!(shell_word("it's"), r"'it'\''s'");
    assert_eq!(shell_word(""), "''");
}
