//! `top`'s model (aggregation, sorting, filtering, rates) fed through its session sink, and
//! both views rendered: the full-screen one with ratatui's TestBackend at several sizes
//! (numbers never cut, headers whole), the batch one as text.
//!
//! Over 500 lines: tests only.
use std::{collections::BTreeMap, time::Duration};

use memtrace_common::{Kind, TaskEvent, flags};
use ratatui::{
    Terminal,
    backend::TestBackend,
    crossterm::event::{KeyCode, KeyEvent, KeyModifiers},
};

use super::{
    batch::render_batch,
    model::{Column, DomainTotals, LiveView, Row, Snapshot, ViewOptions},
    tui::{ViewState, draw, handle_key},
};
use crate::{
    analysis::{Domain, Stats},
    columns::{ColumnChoice, Layout, NAME_MIN_WIDTH, Width},
    event::{Alloc, Event, Free, Task},
    grouping::{DomainFilter, GroupBy, GroupKey},
    session::Sink,
    stacks::Frame,
};

fn frame(function: &str, line: u32, kernel: bool) -> Frame {
    Frame {
        function: function.into(),
        file: (!kernel).then(|| "/src/app.c".into()),
        line: (!kernel).then_some(line),
        module: if kernel { "[kernel]".into() } else { "app".into() },
        address: u64::from(line),
        kernel,
        inlined: false,
        python: false,
        unknown: false,
        wrapper: false,
    }
}

fn row(domain: Domain, label: &str, frames: Vec<Frame>, allocs: u64, req: u64, alloc: u64, live: u64) -> Row {
    let stats = Stats {
        allocs,
        frees: allocs - 1,
        bytes_req: req,
        bytes_alloc: alloc,
        live_allocs: 1,
        live_bytes_req: live,
        live_bytes_alloc: live,
        ..Default::default()
    };
    Row {
        key: GroupKey::Function(domain, label.into()),
        domain,
        label: label.into(),
        frames,
        stats,
        allocs_per_sec: allocs as f64 / 2.0,
        bytes_per_sec: req as f64 / 2.0,
        growth: live as i64,
        allocator: None,
    }
}

fn snapshot() -> Snapshot {
    let user = Stats {
        allocs: 3000,
        frees: 2998,
        bytes_req: 300_000,
        bytes_alloc: 330_000,
        live_allocs: 2,
        live_bytes_req: 4096,
        ..Default::default()
    };
    let mut totals = BTreeMap::new();
    totals.insert(Domain::User, DomainTotals { stats: user, unmatched_frees: 0 });
    Snapshot {
        interval: Duration::from_secs(1),
        totals,
        allocs_per_sec: 1500.0,
        frees_per_sec: 1499.0,
        bytes_per_sec: 150_000.0,
        lost_events: 0,
        untracked: 0,
        live_limit: 1000,
        rows: vec![
            row(
                Domain::User,
                "parse_request (app.c:42) ← serve (app.c:90)",
                vec![frame("parse_request", 42, false), frame("serve", 90, false)],
                2000,
                200_000,
                220_000,
                4000,
            ),
            row(
                Domain::Kernel,
                "alloc_pipe_info ← create_pipe_files",
                vec![frame("alloc_pipe_info", 1, true), frame("create_pipe_files", 2, true)],
                1000,
                100_000,
                110_000,
                96,
            ),
        ],
    }
}

/// A busier snapshot: large figures, long names.
fn busy_snapshot() -> Snapshot {
    let mut snap = snapshot();
    snap.allocs_per_sec = 12_345_678.0;
    snap.bytes_per_sec = 3.5e9;
    snap.lost_events = 1_234_567;
    let long = "std::collections::hash::map::HashMap<K,V,S>::insert (map.rs:1105) ← \
                serde_json::de::Deserializer<R>::parse_object (de.rs:2010) ← main (main.rs:12)";
    snap.rows.push(row(Domain::User, long, vec![frame("insert", 1105, false)], 98_765_432, 1 << 40, 1 << 41, 1 << 33));
    snap.rows[2].growth = -(1 << 32);
    snap.rows[2].allocs_per_sec = 1_234_567.0;
    snap.rows[2].bytes_per_sec = 1023.9 * 1024.0 * 1024.0;
    snap.rows[2].stats.live_allocs = 12_345_678;
    snap
}

fn state() -> ViewState {
    ViewState {
        options: ViewOptions {
            by: GroupBy::Site,
            domain: DomainFilter::Both,
            sort: Column::BytesPerSec,
            filter: String::new(),
        },
        columns: ColumnChoice::Fit,
        paused: false,
        expanded: false,
        selected: 0,
        editing_filter: None,
        title: "memtrace top — pid 42".into(),
        status: String::new(),
    }
}

fn render_at(state: &ViewState, snap: &Snapshot, width: u16, height: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
    terminal.draw(|f| draw(f, state, snap)).unwrap();
    terminal.backend().to_string()
}

fn render(state: &ViewState, snap: &Snapshot) -> String {
    render_at(state, snap, 110, 16)
}

#[test]
fn renders_header_table_and_help() {
    insta::assert_snapshot!("top_default", render(&state(), &snapshot()));
}

#[test]
fn renders_the_selected_rows_stack_and_the_table_full_warning() {
    let mut st = state();
    st.expanded = true;
    st.selected = 1;
    st.paused = true;
    let mut snap = snapshot();
    snap.untracked = 12;
    insta::assert_snapshot!("top_expanded", render(&st, &snap));
}

#[test]
fn the_detail_view_names_the_rows_allocator_family() {
    let mut st = state();
    st.expanded = true;
    let mut snap = snapshot();
    snap.rows[0].allocator = Some("jemalloc");
    let screen = render(&st, &snap);
    let title = screen.lines().find(|l| l.contains("stack of")).unwrap_or_default().to_string();
    assert!(title.contains("(jemalloc)"), "{screen}");
}

/// The screen's lines, without TestBackend's quotes.
fn screen_lines(screen: &str) -> Vec<String> {
    screen.lines().map(|l| l.trim_matches('"').to_string()).collect()
}

/// Every figure of every row shown whole, every header whole, names ellipsized but not
/// narrower than the minimum.
/// The columns a header line names, failing on a cut header.
fn header_columns(header: &str) -> Vec<Column> {
    let words: Vec<&str> = header.split_whitespace().collect();
    let mut shown = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let two = words.get(i + 1).map(|next| format!("{} {next}", words[i]));
        if let Some(c) = Column::DISPLAY.into_iter().find(|c| Some(c.header()) == two.as_deref()) {
            shown.push(c);
            i += 2;
            continue;
        }
        match Column::DISPLAY.into_iter().find(|c| c.header() == words[i]) {
            Some(c) => shown.push(c),
            None => assert_eq!(words[i], "SITE", "header cut: {:?} in {header:?}", words[i]),
        }
        i += 1;
    }
    shown
}

fn assert_fits(screen: &str, snap: &Snapshot, width: usize) -> Vec<Column> {
    let lines = screen_lines(screen);
    let header = lines.iter().find(|l| l.contains("SITE")).unwrap_or_else(|| panic!("no header:\n{screen}"));
    let shown = header_columns(header);
    assert!(shown.contains(&Column::BytesPerSec), "the column sorted by stays:\n{screen}");
    for r in &snap.rows {
        let first = r.frames.first().map_or(r.label.as_str(), |f| &*f.function);
        let line = lines
            .iter()
            .find(|l| l.contains(&r.label[..r.label.len().min(12)]) || l.contains(first))
            .unwrap_or_else(|| panic!("no row for {} in\n{screen}", r.label));
        for c in &shown {
            assert!(line.contains(&format!(" {}", c.cell(r))), "{} cut in {line:?}", c.header());
        }
        let name_at = line.find(&r.label[..12]).unwrap();
        let name_width = line[name_at..].trim_end().chars().count();
        assert!(name_width >= NAME_MIN_WIDTH.min(r.label.chars().count()), "{line:?}");
        assert!(line.chars().count() <= width);
    }
    shown
}

#[test]
fn a_small_terminal_drops_columns_instead_of_cutting_them() {
    let snap = busy_snapshot();
    let screen = render_at(&state(), &snap, 80, 24);
    let shown = assert_fits(&screen, &snap, 80);
    assert_eq!(shown, [Column::AllocsPerSec, Column::BytesPerSec, Column::Live, Column::Growth], "{screen}");
    // --wide leaves the names less room, for more figures.
    let mut wide = state();
    wide.columns = ColumnChoice::All;
    let wide_screen = render_at(&wide, &snap, 80, 24);
    let more = assert_fits(&wide_screen, &snap, 80);
    assert!(more.len() > shown.len(), "{wide_screen}");
    assert!(screen.contains("…"), "the long name is ellipsized:\n{screen}");
    assert!(screen.contains("lost 1,234,567"), "summary flowed, not cut:\n{screen}");
    assert!(screen.contains("esc close"), "help flowed, not cut:\n{screen}");
    insta::assert_snapshot!("top_80x24", screen);
}

#[test]
fn a_large_terminal_shows_every_column() {
    let snap = busy_snapshot();
    let screen = render_at(&state(), &snap, 200, 50);
    assert_eq!(assert_fits(&screen, &snap, 200), Column::DISPLAY);
    insta::assert_snapshot!("top_200x50", screen);
}

#[test]
fn listed_fields_pick_the_columns() {
    let mut st = state();
    st.columns = ColumnChoice::Listed(vec![Column::Allocs, Column::Growth]);
    let screen = render_at(&st, &snapshot(), 110, 16);
    let header = screen_lines(&screen).into_iter().find(|l| l.contains("SITE")).unwrap();
    assert_eq!(header.split_whitespace().collect::<Vec<_>>(), ["ALLOCS", "GROWTH", "SITE"], "{screen}");
}

fn key(code: KeyCode) -> KeyEvent {
    KeyEvent::new(code, KeyModifiers::NONE)
}

/// A terminal whose input ends sends ^D; Ctrl-Space reads as NUL: neither changes the view
/// (^D read as 'd', or NUL as ' ', left `top` paused on its first frame).
#[test]
fn keys_with_ctrl_or_alt_are_no_commands_but_ctrl_c_quits() {
    let mut st = state();
    for (code, modifiers) in [
        (KeyCode::Char('d'), KeyModifiers::CONTROL),
        (KeyCode::Char(' '), KeyModifiers::CONTROL),
        (KeyCode::Char('p'), KeyModifiers::ALT),
        (KeyCode::Char('q'), KeyModifiers::CONTROL),
    ] {
        assert!(handle_key(&mut st, KeyEvent::new(code, modifiers), 2), "{code:?} {modifiers:?}");
    }
    assert!(!st.paused);
    assert_eq!((st.options.domain, st.options.sort), (state().options.domain, state().options.sort));
    assert!(!handle_key(&mut st, KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL), 2));
}

#[test]
fn keys_change_the_view() {
    let mut st = state();
    assert!(handle_key(&mut st, key(KeyCode::Char('s')), 2));
    assert_eq!(st.options.sort, Column::Live);
    assert!(handle_key(&mut st, key(KeyCode::Char('S')), 2));
    assert_eq!(st.options.sort, Column::BytesPerSec);
    handle_key(&mut st, key(KeyCode::Char('d')), 2);
    assert_eq!(st.options.domain, DomainFilter::User);
    handle_key(&mut st, key(KeyCode::Char('g')), 2);
    assert_eq!(st.options.by, GroupBy::Function);
    handle_key(&mut st, key(KeyCode::Char('p')), 2);
    assert!(st.paused);
    handle_key(&mut st, key(KeyCode::Down), 2);
    handle_key(&mut st, key(KeyCode::Down), 2);
    assert_eq!(st.selected, 1, "selection stays on the last row");
    handle_key(&mut st, key(KeyCode::Enter), 2);
    assert!(st.expanded);
    assert!(handle_key(&mut st, key(KeyCode::Esc), 2), "esc closes the stack first");
    assert!(!st.expanded);
    // Typing a filter.
    handle_key(&mut st, key(KeyCode::Char('/')), 2);
    for c in "pars".chars() {
        handle_key(&mut st, key(KeyCode::Char(c)), 2);
    }
    assert_eq!(st.options.filter, "", "applied only on enter");
    handle_key(&mut st, key(KeyCode::Enter), 2);
    assert_eq!(st.options.filter, "pars");
    assert!(!handle_key(&mut st, key(KeyCode::Char('q')), 2));
    assert!(!handle_key(&mut st, KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL), 2));
}

fn wide() -> Layout<Column> {
    Layout { width: Width::Unlimited, columns: ColumnChoice::All }
}

#[test]
fn batch_snapshots_align_columns() {
    let text = render_batch(&snapshot(), "memtrace top — pid 42", &state().options, 10, &wide());
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[1].starts_with("allocs 1.5k/s  frees 1.5k/s"), "{text}");
    let header = lines.iter().position(|l| l.contains("ALLOCS/s")).unwrap();
    let site_col = lines[header].find("SITE").unwrap();
    assert_eq!(lines[header + 1].find("parse_request"), Some(site_col), "{text}");
    assert_eq!(lines[header + 2].find("alloc_pipe_info"), Some(site_col), "{text}");
}

/// The columns fitted to a batch's first snapshot stay for the later ones, whatever their
/// figures' widths (a program reading `top -b` met GROWTH, then FRAG in its place).
#[test]
fn batch_snapshots_keep_the_first_ones_columns() {
    let view = state().options;
    let header = |text: &str| -> Vec<String> {
        text.lines().find(|l| l.contains("SITE")).unwrap().split_whitespace().map(String::from).collect()
    };
    for width in [60, 80, 100] {
        let fit = Layout { width: Width::Columns(width), columns: ColumnChoice::Fit };
        let first = snapshot();
        let kept = crate::top::batch::fitted_columns(&first, &view, 10, &fit);
        let later = Layout { width: Width::Columns(width), columns: ColumnChoice::Listed(kept) };
        let first_header = header(&render_batch(&first, "t", &view, 10, &later));
        let busy = busy_snapshot();
        let text = render_batch(&busy, "t", &view, 10, &later);
        assert_eq!(header(&text), first_header, "{width}");
        // Counted at the widths their figures may reach, they still fit.
        for l in text.lines().skip_while(|l| !l.contains("SITE")) {
            assert!(l.chars().count() <= width, "{width}: {l:?}\n{text}");
        }
    }
}

#[test]
fn batch_snapshots_fit_the_width() {
    let snap = busy_snapshot();
    let view = state().options;
    let wide_text = render_batch(&snap, "memtrace top — pid 42", &view, 10, &wide());
    assert_eq!(
        wide_text.lines().find(|l| l.contains("SITE")).unwrap(),
        "   ALLOCS/s       BYTES/s        LIVE  LIVE BYTES   FRAG    GROWTH      ALLOCS  SITE"
    );
    for width in [80, 120] {
        let layout = Layout { width: Width::Columns(width), columns: ColumnChoice::Fit };
        let text = render_batch(&snap, "memtrace top — pid 42", &view, 10, &layout);
        for l in text.lines() {
            assert!(l.chars().count() <= width, "{width}: {l:?}\n{text}");
        }
        let rows: Vec<&str> = text.lines().skip_while(|l| !l.contains("SITE")).skip(1).collect();
        let wide_rows: Vec<&str> = wide_text.lines().skip_while(|l| !l.contains("SITE")).skip(1).collect();
        for (narrow, wide) in rows.iter().zip(&wide_rows) {
            // Every figure shown is one of the row's figures, whole.
            let figures: Vec<&str> = wide.split("  ").map(str::trim).filter(|s| !s.is_empty()).collect();
            let shown: Vec<&str> = narrow.split("  ").map(str::trim).filter(|s| !s.is_empty()).collect();
            for f in &shown[..shown.len() - 1] {
                assert!(figures.contains(f), "{width}: {f:?} of {narrow:?} is not in {wide:?}");
            }
        }
    }
    insta::assert_snapshot!(
        "top_batch_80",
        render_batch(&snap, "memtrace top — pid 42", &view, 10, &Layout::default())
    );
}

// ---------------------------------------------------------------------------------------
// The model, fed through its sink.
// ---------------------------------------------------------------------------------------

fn exec(pid: u32, comm: &str) -> Event {
    Event::Task(Task {
        ts_ns: 1,
        event: TaskEvent::Exec,
        flags: 0,
        pid,
        tid: pid,
        ppid: 1,
        comm: comm.into(),
        filename: format!("/usr/bin/{comm}"),
    })
}

fn alloc(ts: u64, pid: u32, kind: Kind, ptr: u64, req: u64) -> Event {
    Event::Alloc(Alloc {
        ts_ns: ts,
        pid,
        tid: pid,
        cpu: 0,
        kind,
        flags: 0,
        ptr,
        bytes_req: req,
        bytes_alloc: req + 16,
        stack: 0,
        call_site: 0,
        gfp_flags: 0,
        node: -1,
        order: 0,
        allocator: 0,
        cache: 0,
    })
}

fn free(ts: u64, pid: u32, kind: Kind, ptr: u64) -> Event {
    Event::Free(Free { ts_ns: ts, pid, tid: pid, cpu: 0, kind, flags: 0, ptr, arg: 0 })
}

/// Two processes: `web` mallocs 10 × 100 bytes (frees 8) and callocs 1 × 5000; `db`
/// mallocs 3 × 1000 (frees none); the kernel kmallocs 4 × 64 for `db` (frees 4).
fn fed_view() -> LiveView {
    let mut view = LiveView::new(1000, None, None);
    view.event(exec(10, "web"));
    view.event(exec(20, "db"));
    let mut ts = 100;
    let mut tick = || {
        ts += 10;
        ts
    };
    for i in 0..10 {
        view.event(alloc(tick(), 10, Kind::Malloc, 0x1000 + i * 0x100, 100));
    }
    for i in 0..8 {
        view.event(free(tick(), 10, Kind::Free, 0x1000 + i * 0x100));
    }
    view.event(alloc(tick(), 10, Kind::Calloc, 0x9000, 5000));
    for i in 0..3 {
        view.event(alloc(tick(), 20, Kind::Malloc, 0x1000 + i * 0x1000, 1000));
    }
    for i in 0..4 {
        view.event(alloc(tick(), 20, Kind::Kmalloc, 0xffff_0000 + i * 0x40, 64));
        view.event(free(tick(), 20, Kind::Kfree, 0xffff_0000 + i * 0x40));
    }
    view
}

fn options(by: GroupBy, sort: Column) -> ViewOptions {
    ViewOptions { by, domain: DomainFilter::Both, sort, filter: String::new() }
}

fn summary_of(snap: &Snapshot) -> Vec<(String, u64, u64, u64)> {
    snap.rows.iter().map(|r| (r.label.clone(), r.stats.allocs, r.stats.bytes_req, r.stats.live_allocs)).collect()
}

#[test]
fn the_model_aggregates_per_process_and_sorts() {
    let mut view = fed_view();
    assert_eq!(view.events, 2 + 10 + 8 + 1 + 3 + 8);
    let snap = view.snapshot(&options(GroupBy::Process, Column::Allocs), Duration::from_secs(2), 7);
    assert_eq!(
        summary_of(&snap),
        [
            ("web [10]".to_string(), 11, 6000, 3),
            ("db [20]".to_string(), 4, 256, 0),
            ("db [20]".to_string(), 3, 3000, 3),
        ]
    );
    assert_eq!(snap.rows[1].domain, Domain::Kernel);
    assert_eq!((snap.rows[0].allocs_per_sec, snap.rows[0].bytes_per_sec), (5.5, 3000.0));
    assert_eq!(snap.rows[0].growth, 0, "growth counts from the row's first appearance");
    assert_eq!(snap.lost_events, 7);
    assert_eq!(snap.totals[&Domain::User].stats.allocs, 14);
    assert_eq!(snap.totals[&Domain::Kernel].stats.frees, 4);
    assert_eq!(snap.allocs_per_sec, 9.0);

    let by_live = view.snapshot(&options(GroupBy::Process, Column::Live), Duration::from_secs(1), 7);
    assert_eq!(by_live.rows[0].label, "web [10]", "5,200 live bytes before 3,000");
    assert_eq!(by_live.rows[0].allocs_per_sec, 0.0, "nothing new since the last snapshot");
    assert_eq!(by_live.allocs_per_sec, 0.0);
}

/// `top` shows what is live now: an exited process's blocks go with it, from the rows,
/// the totals and the live table (`-a` on a busy host filled it with the dead's blocks).
#[test]
fn an_exited_process_has_nothing_live() {
    let exit = |pid: u32, ts_ns: u64| {
        Event::Task(Task {
            ts_ns,
            event: TaskEvent::Exit,
            flags: flags::GROUP_DEAD,
            pid,
            tid: pid,
            ppid: 1,
            comm: "ls".into(),
            filename: String::new(),
        })
    };
    // The traced command's leaks at exit stay, as report shows them; its children's go.
    let mut kept = LiveView::new(5, None, Some(30));
    for pid in [30, 40] {
        kept.event(exec(pid, "ls"));
        kept.event(alloc(u64::from(pid), pid, Kind::Malloc, 0x1000, 100 + u64::from(pid)));
        kept.event(exit(pid, u64::from(pid) + 1));
    }
    let snap = kept.snapshot(&options(GroupBy::Process, Column::Live), Duration::from_secs(1), 0);
    assert_eq!(snap.totals[&Domain::User].stats.live_bytes_req, 130);
    // Under -a (no target): each process's blocks go with it.
    let mut view = LiveView::new(5, None, None);
    view.event(exec(30, "ls"));
    for i in 0..4 {
        view.event(alloc(2 + i, 30, Kind::Malloc, 0x1000 + i * 0x100, 100));
    }
    let live = |view: &mut LiveView| {
        let snap = view.snapshot(&options(GroupBy::Process, Column::Live), Duration::from_secs(1), 0);
        (snap.rows.first().map_or(0, |r| r.stats.live_bytes_req), snap.totals[&Domain::User].stats.live_bytes_req)
    };
    assert_eq!(live(&mut view), (400, 400));
    view.event(exit(30, 10));
    assert_eq!(live(&mut view), (0, 0));
    // Its blocks no longer hold the live table (5 blocks at most): the next ones are followed.
    view.event(exec(31, "ls"));
    for i in 0..4 {
        view.event(alloc(20 + i, 31, Kind::Malloc, 0x1000 + i * 0x100, 100));
    }
    let snap = view.snapshot(&options(GroupBy::Process, Column::Live), Duration::from_secs(1), 0);
    assert_eq!(snap.untracked, 0, "the live table holds no dead process's block");
    assert_eq!(snap.rows.iter().map(|r| r.stats.live_bytes_req).sum::<u64>(), 400);
}

#[test]
fn the_model_groups_by_site_and_filters() {
    let mut view = fed_view();
    // No stacks: the kind names the site.
    let snap = view.snapshot(&options(GroupBy::Site, Column::BytesPerSec), Duration::from_secs(1), 0);
    assert_eq!(
        summary_of(&snap),
        [
            ("[no stack: calloc]".to_string(), 1, 5000, 1),
            ("[no stack: malloc]".to_string(), 13, 4000, 5),
            ("[no stack: kmalloc]".to_string(), 4, 256, 0),
        ]
    );
    let mut kernel = options(GroupBy::Site, Column::Allocs);
    kernel.domain = DomainFilter::Kernel;
    let snap = view.snapshot(&kernel, Duration::from_secs(1), 0);
    assert_eq!(summary_of(&snap), [("[no stack: kmalloc]".to_string(), 4, 256, 0)]);
    assert!(!snap.totals.contains_key(&Domain::User));

    let mut filtered = options(GroupBy::Process, Column::Allocs);
    filtered.filter = "DB".into();
    let snap = view.snapshot(&filtered, Duration::from_secs(1), 0);
    assert_eq!(snap.rows.len(), 2);
    assert!(snap.rows.iter().all(|r| r.label == "db [20]"));
}

#[test]
fn rows_rates_add_up_to_the_summarys_even_when_names_change() {
    use crate::event::{RawUserFrame, StackRecord, UserWalk};
    let mut view = fed_view();
    let opts = options(GroupBy::Site, Column::BytesPerSec);
    let _ = view.snapshot(&opts, Duration::from_secs(1), 0);
    // Allocations whose stack arrives after them: their row is "[no stack: …]" at first,
    // then named after the stack; their rate is still what they did in the interval.
    let hash = 0x5eed;
    for i in 0..10 {
        let mut e = alloc(1000 + i, 10, Kind::Malloc, 0x40_0000 + i * 0x100, 100);
        if let Event::Alloc(a) = &mut e {
            a.stack = hash;
        }
        view.event(e);
    }
    let first = view.snapshot(&opts, Duration::from_secs(1), 0);
    let sum = |s: &Snapshot| s.rows.iter().map(|r| r.bytes_per_sec).sum::<f64>();
    assert_eq!((first.bytes_per_sec, sum(&first)), (1000.0, 1000.0));
    view.stack(StackRecord {
        hash,
        pid: 10,
        asid: 0,
        kernel: vec![],
        user: vec![RawUserFrame::Ip(0x1234)],
        walk: UserWalk::FramePointers,
        truncated: false,
        no_room: false,
        joined_kernel: false,
        miss: None,
        python_context: None,
        py_key: 0,
    });
    view.event(alloc(2000, 10, Kind::Malloc, 0x50_0000, 100));
    let second = view.snapshot(&opts, Duration::from_secs(1), 0);
    assert_eq!(second.bytes_per_sec, 100.0);
    assert_eq!(sum(&second), 100.0, "{:#?}", second.rows);
    // Regrouping does not make rates jump either.
    view.reset_reference();
    view.event(alloc(3000, 20, Kind::Malloc, 0x60_0000, 50));
    let third = view.snapshot(&options(GroupBy::Process, Column::BytesPerSec), Duration::from_secs(1), 0);
    assert_eq!((third.bytes_per_sec, sum(&third)), (50.0, 50.0));
}

#[test]
fn processes_are_named_even_when_gone_before_they_were_asked() {
    let mut view = LiveView::new(1000, None, None);
    // A process not running any more (no /proc entry): named at its exit.
    let pid = 4_194_000;
    view.event(alloc(10, pid, Kind::Malloc, 0x10, 8));
    view.event(Event::Task(Task {
        ts_ns: 20,
        event: TaskEvent::Exit,
        flags: 0,
        pid,
        tid: pid,
        ppid: 0,
        comm: "git".into(),
        filename: String::new(),
    }));
    view.event(alloc(30, 0, Kind::Kmalloc, 0xffff_0000, 8));
    let snap = view.snapshot(&options(GroupBy::Process, Column::Allocs), Duration::from_secs(1), 0);
    let labels: Vec<&str> = snap.rows.iter().map(|r| r.label.as_str()).collect();
    assert!(labels.contains(&"git [4194000]") && labels.contains(&"swapper [0]"), "{labels:?}");
}
