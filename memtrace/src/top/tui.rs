//! `top`'s full-screen view (ratatui): the summary, the table fitted to the screen's width,
//! a row's stack on demand, and the keys that change the view. Also the loop that drains
//! the session, refreshes the model and redraws.
use std::time::{Duration, Instant};

use anyhow::Result;
use ratatui::{
    Frame,
    crossterm::event::{self, Event as TermEvent, KeyCode, KeyEvent, KeyEventKind, KeyModifiers},
    layout::{Constraint, Layout, Rect},
    style::{Modifier, Style, Stylize as _},
    text::{Line, Span},
    widgets::{Block, Borders, Cell, Paragraph, Row as TableRow, Table, TableState},
};

use super::{
    DRAIN_INTERVAL, TopOptions,
    model::{Column, LiveView, Row, Snapshot, ViewOptions},
    table::{SCREEN_SPACING, domain_cell, names_header, screen_columns, summary},
    title,
};
use crate::{
    columns::{ColumnChoice, Width, ellipsize, flow},
    grouping::{DomainFilter, GroupBy},
    session::{Tracer, Wake, WakeLoop},
};

/// Interactive state of the full-screen view.
#[derive(Debug, Clone)]
pub struct ViewState {
    pub options: ViewOptions,
    /// The figures to show (`--wide`, `--fields`); the screen's width has the last word.
    pub columns: ColumnChoice<Column>,
    pub paused: bool,
    pub expanded: bool,
    pub selected: usize,
    /// Filter being typed (None: not typing).
    pub editing_filter: Option<String>,
    pub title: String,
    pub status: String,
}

/// The keys, as the help line lists them.
pub const HELP: [&str; 9] =
    ["q quit", "s/S sort", "d user/kernel/both", "g group", "/ filter", "p pause", "↑↓ select", "⏎ stack", "esc close"];

/// The selection mark before the selected row.
const HIGHLIGHT: &str = "▶";

pub fn draw(frame: &mut Frame<'_>, state: &ViewState, snap: &Snapshot) {
    let area = frame.area();
    let width = Width::Columns(usize::from(area.width));
    let header_lines = summary(snap, &state.title, &state.status, width);
    let help_lines = flow(&HELP.map(String::from), width);
    let detail = if state.expanded { 12 } else { 0 };
    let [head, table_area, detail_area, help_area] = Layout::vertical([
        Constraint::Length(header_lines.len() as u16 + 1),
        Constraint::Min(3),
        Constraint::Length(detail),
        Constraint::Length(help_lines.len() as u16),
    ])
    .areas(area);
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

    render_table(frame, table_area, state, snap);
    if state.expanded {
        render_stack(frame, detail_area, snap.rows.get(state.selected));
    }
    let help: Vec<Line<'_>> = help_lines.into_iter().map(Line::from).collect();
    frame.render_widget(Paragraph::new(help).style(Style::new().add_modifier(Modifier::DIM)), help_area);
}

/// The rows, with the figures that fit: right-aligned numbers, the names left-aligned and
/// ellipsized.
fn render_table(frame: &mut Frame<'_>, area: Rect, state: &ViewState, snap: &Snapshot) {
    let opts = &state.options;
    // The selection mark, the domain column and the spacing after it.
    let overhead = HIGHLIGHT.chars().count() + 1 + SCREEN_SPACING;
    let fitted = screen_columns(&snap.rows, opts.by, opts.sort, &state.columns, usize::from(area.width), overhead);
    let right = |s: String| Cell::from(Line::from(s).right_aligned());
    let mut header_cells = vec![Cell::from("")];
    for (c, _) in &fitted.columns {
        let cell = Cell::from(Line::from(c.header()).right_aligned());
        header_cells.push(if *c == opts.sort {
            cell.style(Style::new().add_modifier(Modifier::BOLD | Modifier::UNDERLINED))
        } else {
            cell
        });
    }
    header_cells.push(Cell::from(names_header(opts.by)));
    let header = TableRow::new(header_cells).style(Style::new().add_modifier(Modifier::REVERSED));
    let rows = snap.rows.iter().map(|r| {
        let mut cells = vec![Cell::from(domain_cell(r))];
        cells.extend(fitted.columns.iter().map(|(c, _)| right(c.cell(r))));
        cells.push(Cell::from(ellipsize(&r.label, fitted.names_width)));
        TableRow::new(cells)
    });
    let mut widths = vec![Constraint::Length(1)];
    widths.extend(fitted.columns.iter().map(|(_, w)| Constraint::Length(*w as u16)));
    widths.push(Constraint::Fill(1));
    let table = Table::new(rows, widths)
        .header(header)
        .column_spacing(SCREEN_SPACING as u16)
        .row_highlight_style(Style::new().add_modifier(Modifier::BOLD))
        .highlight_symbol(HIGHLIGHT);
    let mut table_state =
        TableState::default().with_selected(Some(state.selected.min(snap.rows.len().saturating_sub(1))));
    frame.render_stateful_widget(table, area, &mut table_state);
}

fn render_stack(frame: &mut Frame<'_>, area: Rect, row: Option<&Row>) {
    let width = usize::from(area.width);
    let lines: Vec<Line<'_>> = match row {
        Some(r) => r
            .frames
            .iter()
            .map(|f| Line::from(ellipsize(&format!("{}{f}", if f.kernel { "[k] " } else { "" }), width)))
            .collect(),
        None => vec![Line::from("(no row selected)")],
    };
    let title = row
        .map(|r| match r.allocator {
            Some(family) => format!(" stack of {} ({family}) ", r.label),
            None => format!(" stack of {} ", r.label),
        })
        .unwrap_or_default();
    frame.render_widget(Paragraph::new(lines).block(Block::new().borders(Borders::TOP).title(title)), area);
}

/// What a key does to the view. Returns false to quit.
pub fn handle_key(state: &mut ViewState, key: KeyEvent, rows: usize) -> bool {
    if key.kind != KeyEventKind::Press {
        return true;
    }
    // Ctrl-C quits; any other key with Ctrl or Alt is no command (a terminal whose input
    // ends sends ^D, Ctrl-Space reads as NUL: neither is 'd' or ' ').
    if key.modifiers.intersects(KeyModifiers::CONTROL | KeyModifiers::ALT) {
        return !(key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL));
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
                DomainFilter::Kernel => DomainFilter::Gpu,
                DomainFilter::Gpu => DomainFilter::Both,
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

/// Restores the terminal however the view ends.
struct TerminalGuard;
impl Drop for TerminalGuard {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

pub(super) async fn interactive(tracer: &mut Tracer, live: &mut LiveView, opts: &TopOptions) -> Result<i32> {
    let mut terminal = ratatui::try_init()?;
    let _guard = TerminalGuard;
    let mut waker = WakeLoop::new(tracer, DRAIN_INTERVAL, None)?;
    let mut state = ViewState {
        options: opts.view.clone(),
        columns: opts.layout.columns.clone(),
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
                state.status = match tracer.reap_command().and(tracer.command_ended.as_deref()) {
                    Some(how) => format!("  (the command {how})"),
                    None => "  (the process exited)".into(),
                };
                redraw = true;
            }
            Wake::Signal(_) => return Ok(0),
            _ => {}
        }
        tracer.drain(live, false);
        tracer.housekeeping();
        live.allocator_families = tracer.allocators.iter().map(|a| a.family.name()).collect();
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
