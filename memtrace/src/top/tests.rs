//! `top`'s views rendered: the full-screen one with ratatui's TestBackend, the batch one as
//! text; and the keys.
use std::{collections::BTreeMap, time::Duration};

use ratatui::{
    Terminal,
    backend::TestBackend,
    crossterm::event::{KeyCode, KeyEvent, KeyModifiers},
};

use super::{
    batch::render_batch,
    model::{Column, DomainTotals, Row, Snapshot, ViewOptions},
    tui::{ViewState, draw, handle_key},
};
use crate::{
    analysis::{Domain, Stats},
    columns::{ColumnChoice, Layout, Width},
    grouping::{DomainFilter, GroupBy, GroupKey},
    stacks::Frame,
};

fn frame(function: &str, line: u32, kernel: bool) -> Frame {
    Frame {
        function: function.into(),
        file: (!kernel).then(|| "/src/app.c".to_string()),
        line: (!kernel).then_some(line),
        module: if kernel { "[kernel]".into() } else { "app".into() },
        address: u64::from(line),
        kernel,
        inlined: false,
        unknown: false,
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

fn render(state: &ViewState, snap: &Snapshot) -> String {
    let mut terminal = Terminal::new(TestBackend::new(110, 16)).unwrap();
    terminal.draw(|f| draw(f, state, snap)).unwrap();
    terminal.backend().to_string()
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

fn key(code: KeyCode) -> KeyEvent {
    KeyEvent::new(code, KeyModifiers::NONE)
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
