//! `memtrace top`: a live view of allocations, refreshed every interval — full-screen with
//! ratatui (sort, domain, grouping, filter, pause, expand a row's stack), or `-b` batch
//! snapshots on stdout for scripts and logs. The terminal is restored on quit, Ctrl-C,
//! SIGTERM, errors and panics.
use std::{
    io::{self, Write as _},
    time::{Duration, Instant},
};

use anyhow::Result;
use ratatui::{
    Frame,
    crossterm::event::{self, Event as TermEvent, KeyCode, KeyEvent, KeyEventKind, KeyModifiers},
    layout::{Constraint, Layout, Rect},
    style::{Modifier, Style, Stylize as _},
    text::{Line, Span},
    widgets::{Block, Borders, Cell, Paragraph, Row as TableRow, Table, TableState},
};

use crate::{
    analysis::Domain,
    live::{Column, LiveView, Row, Snapshot, ViewOptions},
    report::{DomainFilter, GroupBy, bytes, count},
    session::{TraceOptions, Tracer, Wake, Waker, block_on},
};

#[derive(Debug, Clone)]
pub struct TopOptions {
    pub trace: TraceOptions,
    pub interval: Duration,
    /// Plain-text snapshots on stdout instead of the full-screen view.
    pub batch: bool,
    /// Stop after this many refreshes.
    pub iterations: Option<u64>,
    /// Live blocks followed at most (memory bound).
    pub live_limit: usize,
    /// Rows per snapshot in batch mode.
    pub rows: usize,
    pub view: ViewOptions,
}

const DRAIN_INTERVAL: Duration = Duration::from_millis(20);

fn rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

fn signed_bytes(v: i64) -> String {
    if v < 0 { format!("-{}", bytes(v.unsigned_abs())) } else { format!("+{}", bytes(v as u64)) }
}

const HEADERS: [&str; 9] = ["", "ALLOCS/s", "BYTES/s", "LIVE", "LIVE BYTES", "FRAG", "GROWTH", "ALLOCS", "SITE"];

fn cells(r: &Row) -> [String; 9] {
    [
        if r.domain == Domain::User { "U" } else { "K" }.into(),
        rate(r.allocs_per_sec),
        format!("{}/s", bytes(r.bytes_per_sec as u64)),
        count(r.stats.live_allocs),
        bytes(r.stats.live_bytes_req),
        format!("{:.1}%", r.stats.frag_pct()),
        signed_bytes(r.growth),
        count(r.stats.allocs),
        r.label.clone(),
    ]
}

/// The summary lines shared by both views.
fn summary(s: &Snapshot, title: &str, status: &str) -> Vec<String> {
    let live: u64 = s.totals.values().map(|t| t.stats.live_bytes_req).sum();
    let live_blocks: u64 = s.totals.values().map(|t| t.stats.live_allocs).sum();
    let alloc: u64 = s.totals.values().map(|t| t.stats.bytes_alloc).sum();
    let req: u64 = s.totals.values().map(|t| t.stats.bytes_req).sum();
    let frag = if alloc == 0 { 0.0 } else { 100.0 - 100.0 * req as f64 / alloc as f64 };
    let mut lines = vec![
        format!("{title}{status}"),
        format!(
            "allocs {}/s  frees {}/s  {}/s requested  live {} ({} blocks)  wasted {} ({frag:.1}%)  lost {}",
            rate(s.allocs_per_sec),
            rate(s.frees_per_sec),
            bytes(s.bytes_per_sec as u64),
            bytes(live),
            count(live_blocks),
            bytes(alloc.saturating_sub(req)),
            count(s.lost_events),
        ),
    ];
    if s.untracked > 0 {
        lines.push(format!(
            "live-block table full ({} blocks): {} allocations counted but not followed; live figures undercount",
            count(s.live_limit as u64),
            count(s.untracked)
        ));
    }
    lines
}

/// One batch snapshot as text: summary, then aligned columns.
pub fn render_batch(s: &Snapshot, title: &str, rows: usize) -> String {
    let mut out = summary(s, title, "").join("\n");
    out.push('\n');
    let body: Vec<[String; 9]> = s.rows.iter().take(rows).map(cells).collect();
    let mut widths: Vec<usize> = HEADERS.iter().map(|h| h.len()).collect();
    for r in &body {
        for (i, c) in r.iter().enumerate().take(8) {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i == 8 {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:>w$}  ", w = widths[i]));
            }
        }
        l.trim_end().to_string()
    };
    out.push_str(&line(&HEADERS.map(String::from)));
    out.push('\n');
    for r in &body {
        out.push_str(&line(r));
        out.push('\n');
    }
    out
}

/// Interactive state of the full-screen view.
#[derive(Debug, Clone)]
pub struct ViewState {
    pub options: ViewOptions,
    pub paused: bool,
    pub expanded: bool,
    pub selected: usize,
    /// Filter being typed (None: not typing).
    pub editing_filter: Option<String>,
    pub title: String,
    pub status: String,
}

pub const HELP: &str =
    "q quit  s/S sort  d user/kernel/both  g group  / filter  p pause  ↑↓ select  ⏎ stack  esc close";

pub fn draw(frame: &mut Frame<'_>, state: &ViewState, snap: &Snapshot) {
    let header_lines = summary(snap, &state.title, &state.status);
    let detail = if state.expanded { 12 } else { 0 };
    let [head, table_area, detail_area, help_area] = Layout::vertical([
        Constraint::Length(header_lines.len() as u16 + 1),
        Constraint::Min(3),
        Constraint::Length(detail),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    let mut head_text: Vec<Line<'_>> = header_lines.into_iter().map(Line::from).collect();
    let opts = &state.options;
    head_text.push(Line::from(vec![
        Span::raw("sort: "),
        Span::raw(opts.sort.name()).bold(),
        Span::raw("  group: "),
        Span::raw(format!("{:?}", opts.by).to_lowercase()).bold(),
        Span::raw("  domain: "),
        Span::raw(format!("{:?}", opts.domain).to_lowercase()).bold(),
        Span::raw(match &state.editing_filter {
            Some(f) => format!("  filter: {f}_"),
            None if !opts.filter.is_empty() => format!("  filter: {}", opts.filter),
            None => String::new(),
        }),
        Span::raw(if state.paused { "  [paused]" } else { "" }),
    ]));
    frame.render_widget(Paragraph::new(head_text), head);

    let sorted_col = match opts.sort {
        Column::AllocsPerSec => 1,
        Column::BytesPerSec => 2,
        Column::Live => 4,
        Column::Frag => 5,
        Column::Growth => 6,
        Column::Allocs => 7,
    };
    let header = TableRow::new(HEADERS.iter().enumerate().map(|(i, h)| {
        let cell = if (1..8).contains(&i) { Cell::from(Line::from(*h).right_aligned()) } else { Cell::from(*h) };
        if i == sorted_col {
            cell.style(Style::new().add_modifier(Modifier::BOLD | Modifier::UNDERLINED))
        } else {
            cell
        }
    }))
    .style(Style::new().add_modifier(Modifier::REVERSED));
    // Numbers right-aligned, the site left-aligned.
    let rows =
        snap.rows.iter().map(|r| {
            TableRow::new(cells(r).into_iter().enumerate().map(|(i, c)| {
                if (1..8).contains(&i) { Cell::from(Line::from(c).right_aligned()) } else { Cell::from(c) }
            }))
        });
    let widths = [
        Constraint::Length(1),
        Constraint::Length(8),
        Constraint::Length(11),
        Constraint::Length(8),
        Constraint::Length(10),
        Constraint::Length(6),
        Constraint::Length(11),
        Constraint::Length(10),
        Constraint::Min(20),
    ];
    let table = Table::new(rows, widths)
        .header(header)
        .row_highlight_style(Style::new().add_modifier(Modifier::BOLD))
        .highlight_symbol("▶");
    let mut table_state =
        TableState::default().with_selected(Some(state.selected.min(snap.rows.len().saturating_sub(1))));
    frame.render_stateful_widget(table, table_area, &mut table_state);

    if state.expanded {
        render_stack(frame, detail_area, snap.rows.get(state.selected));
    }
    frame.render_widget(Paragraph::new(HELP).style(Style::new().add_modifier(Modifier::DIM)), help_area);
}

fn render_stack(frame: &mut Frame<'_>, area: Rect, row: Option<&Row>) {
    let lines: Vec<Line<'_>> = match row {
        Some(r) => r.frames.iter().map(|f| Line::from(format!("{}{f}", if f.kernel { "[k] " } else { "" }))).collect(),
        None => vec![Line::from("(no row selected)")],
    };
    let title = row.map(|r| format!(" stack of {} ", r.label)).unwrap_or_default();
    frame.render_widget(Paragraph::new(lines).block(Block::new().borders(Borders::TOP).title(title)), area);
}

/// What a key does to the view. Returns false to quit.
pub fn handle_key(state: &mut ViewState, key: KeyEvent, rows: usize) -> bool {
    if key.kind != KeyEventKind::Press {
        return true;
    }
    if let Some(filter) = state.editing_filter.as_mut() {
        match key.code {
            KeyCode::Enter => state.options.filter = state.editing_filter.take().unwrap_or_default(),
            KeyCode::Esc => state.editing_filter = None,
            KeyCode::Backspace => {
                filter.pop();
            }
            KeyCode::Char(c) => filter.push(c),
            _ => {}
        }
        return true;
    }
    let opts = &mut state.options;
    match key.code {
        KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => return false,
        KeyCode::Char('q') => return false,
        KeyCode::Esc if state.expanded => state.expanded = false,
        KeyCode::Esc => return false,
        KeyCode::Char('s') | KeyCode::Char('S') => {
            let i = Column::ALL.iter().position(|c| *c == opts.sort).unwrap_or(0);
            let n = Column::ALL.len();
            let next = if key.code == KeyCode::Char('s') { (i + 1) % n } else { (i + n - 1) % n };
            opts.sort = Column::ALL[next];
        }
        KeyCode::Char('d') => {
            opts.domain = match opts.domain {
                DomainFilter::Both => DomainFilter::User,
                DomainFilter::User => DomainFilter::Kernel,
                DomainFilter::Kernel => DomainFilter::Both,
            }
        }
        KeyCode::Char('g') => {
            opts.by = match opts.by {
                GroupBy::Site => GroupBy::Function,
                GroupBy::Function => GroupBy::Process,
                GroupBy::Process => GroupBy::Stack,
                GroupBy::Stack => GroupBy::Site,
            }
        }
        KeyCode::Char('/') => state.editing_filter = Some(opts.filter.clone()),
        KeyCode::Char('p') | KeyCode::Char(' ') => state.paused = !state.paused,
        KeyCode::Enter => state.expanded = !state.expanded,
        KeyCode::Up | KeyCode::Char('k') => state.selected = state.selected.saturating_sub(1),
        KeyCode::Down | KeyCode::Char('j') => state.selected = (state.selected + 1).min(rows.saturating_sub(1)),
        _ => {}
    }
    true
}

fn title(tracer: &Tracer) -> String {
    use crate::session::Target;
    match &tracer.options.target {
        Target::Pid(pid) => format!("memtrace top — pid {pid}"),
        Target::Command(argv) => {
            format!("memtrace top — {} (pid {})", argv[0].to_string_lossy(), tracer.target_pid.unwrap_or(0))
        }
        Target::All => "memtrace top — every process and the kernel".into(),
    }
}

/// Restores the terminal however the view ends.
struct TerminalGuard;
impl Drop for TerminalGuard {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

pub fn run(opts: TopOptions) -> Result<i32> {
    let mut trace = opts.trace.clone();
    // The view owns the screen: the session's own messages would garble it.
    trace.quiet = trace.quiet || !opts.batch;
    let mut tracer = Tracer::start(&trace, || Ok(()))?;
    let mut live = LiveView::new(opts.live_limit, trace.sample_bytes);
    tracer.release()?;
    let result = if opts.batch {
        block_on(batch(&mut tracer, &mut live, &opts))?
    } else {
        block_on(interactive(&mut tracer, &mut live, &opts))?
    };
    tracer.end_command();
    let (teardown, _) = tracer.stop(&mut live);
    teardown.join();
    result
}

async fn batch(tracer: &mut Tracer, live: &mut LiveView, opts: &TopOptions) -> Result<i32> {
    let mut waker = Waker::new(tracer, DRAIN_INTERVAL, None)?;
    let mut last = Instant::now();
    let mut printed = 0u64;
    let title = title(tracer);
    let mut stdout = io::stdout().lock();
    loop {
        let wake = waker.wait().await;
        let finished = match wake {
            Wake::TargetExited => {
                tracer.reap_command();
                true
            }
            Wake::Signal(_) => true,
            _ => false,
        };
        tracer.drain(live, finished);
        tracer.tend();
        if finished || last.elapsed() >= opts.interval {
            let lost = tracer.probes.counters().map(|c| c.lost_events).unwrap_or(0);
            let snap = live.snapshot(&opts.view, last.elapsed(), lost);
            last = Instant::now();
            let text = render_batch(&snap, &format!("{title} — snapshot {}", printed + 1), opts.rows);
            if writeln!(stdout, "{text}").and_then(|()| stdout.flush()).is_err() {
                return Ok(0); // the reader went away
            }
            printed += 1;
        }
        if finished || opts.iterations.is_some_and(|n| printed >= n) {
            return Ok(0);
        }
    }
}

async fn interactive(tracer: &mut Tracer, live: &mut LiveView, opts: &TopOptions) -> Result<i32> {
    let mut terminal = ratatui::try_init()?;
    let _guard = TerminalGuard;
    let mut waker = Waker::new(tracer, DRAIN_INTERVAL, None)?;
    let mut state = ViewState {
        options: opts.view.clone(),
        paused: false,
        expanded: false,
        selected: 0,
        editing_filter: None,
        title: title(tracer),
        status: String::new(),
    };
    let mut last = Instant::now();
    let mut snap = live.snapshot(&state.options, Duration::from_secs(1), 0);
    let mut refreshes = 0u64;
    let mut redraw = true;
    loop {
        match waker.wait().await {
            Wake::TargetExited => {
                let code = tracer.reap_command();
                state.status = match code {
                    Some(c) => format!("  (the command exited with status {c})"),
                    None => "  (the process exited)".into(),
                };
                redraw = true;
            }
            Wake::Signal(_) => return Ok(0),
            _ => {}
        }
        tracer.drain(live, false);
        tracer.tend();
        if let Some((_, mean)) = tracer.degraded
            && live.sample_from.is_none()
        {
            live.sample_from = tracer.degraded;
            state.status = format!("  (rings overflowed: sampling 1/{mean} bytes, estimates)");
        }
        while event::poll(Duration::ZERO)? {
            if let TermEvent::Key(key) = event::read()? {
                let before = (state.options.by, state.options.domain, state.options.filter.clone(), state.options.sort);
                if !handle_key(&mut state, key, snap.rows.len()) {
                    return Ok(0);
                }
                let after = (state.options.by, state.options.domain, state.options.filter.clone(), state.options.sort);
                if before.0 != after.0 {
                    live.reset_reference();
                }
                if before != after && !state.paused {
                    snap = live.snapshot(&state.options, last.elapsed(), snap.lost_events);
                    last = Instant::now();
                }
                redraw = true;
            } else {
                redraw = true; // resize
            }
        }
        if last.elapsed() >= opts.interval && !state.paused {
            let lost = tracer.probes.counters().map(|c| c.lost_events).unwrap_or(0);
            snap = live.snapshot(&state.options, last.elapsed(), lost);
            last = Instant::now();
            refreshes += 1;
            redraw = true;
            if opts.iterations.is_some_and(|n| refreshes >= n) {
                return Ok(0);
            }
        }
        if redraw {
            terminal.draw(|f| draw(f, &state, &snap))?;
            redraw = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use ratatui::{Terminal, backend::TestBackend};

    use super::*;
    use crate::{
        analysis::Stats,
        live::{DomainTotals, RowKey},
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
            key: RowKey::Function(domain, label.into()),
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

    #[test]
    fn batch_snapshots_align_columns() {
        let text = render_batch(&snapshot(), "memtrace top — pid 42", 10);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].starts_with("allocs 1.5k/s  frees 1.5k/s"), "{text}");
        let header = lines.iter().position(|l| l.contains("ALLOCS/s")).unwrap();
        let site_col = lines[header].find("SITE").unwrap();
        assert_eq!(lines[header + 1].find("parse_request"), Some(site_col), "{text}");
        assert_eq!(lines[header + 2].find("alloc_pipe_info"), Some(site_col), "{text}");
    }
}
