//! `top -b`: plain-text snapshots on stdout, for scripts and logs, like `top -b`: each one
//! the summary and the rows, fitted to the terminal's width unless `--wide`.
use std::{
    io::{self, Write as _},
    time::Instant,
};

use anyhow::Result;

use super::{
    DRAIN_INTERVAL, TopOptions,
    model::{Column, LiveView, Snapshot, ViewOptions},
    table::{summary, text_table},
    title,
};
use crate::{
    columns::{ColumnChoice, Layout},
    session::{Tracer, Wake, WakeLoop},
};

/// One batch snapshot as text: summary, then aligned columns (the first `rows` rows).
pub fn render_batch(s: &Snapshot, title: &str, view: &ViewOptions, rows: usize, layout: &Layout<Column>) -> String {
    let mut out = summary(s, title, "", layout.width).join("\n");
    out.push('\n');
    let shown = &s.rows[..rows.min(s.rows.len())];
    out.push_str(&text_table(shown, view.by, view.sort, layout).render(layout.width));
    out
}

/// The figure columns a snapshot's table keeps at `layout`'s width: the later snapshots of
/// a batch show these, so a program reading them meets the same columns each time (fitted
/// anew, a wider figure swapped one column for another between snapshots).
pub fn fitted_columns(s: &Snapshot, view: &ViewOptions, rows: usize, layout: &Layout<Column>) -> Vec<Column> {
    let shown = &s.rows[..rows.min(s.rows.len())];
    let candidates = layout.candidates(&Column::DISPLAY);
    // Column 0 of the table is the domain's. Each counts as wide as its figures may grow
    // (the full-screen view's widths): a first snapshot of small figures kept them all.
    let floors: Vec<usize> = std::iter::once(0).chain(candidates.iter().map(|c| c.min_width())).collect();
    let kept = text_table(shown, view.by, view.sort, layout).kept_at_least(layout.width, &floors);
    kept.into_iter().filter_map(|i| i.checked_sub(1).map(|c| candidates[c])).collect()
}

pub(super) async fn batch(tracer: &mut Tracer, live: &mut LiveView, opts: &TopOptions) -> Result<i32> {
    let mut waker = WakeLoop::new(tracer, DRAIN_INTERVAL, None)?;
    let mut last = Instant::now();
    let mut printed = 0u64;
    let title = title(tracer);
    let mut stdout = io::stdout().lock();
    // Fitted to the first snapshot, then kept.
    let mut layout = opts.layout.clone();
    loop {
        let wake = waker.wait().await;
        let finished = match wake {
            Wake::TargetExited => {
                // Said as `record` says it: the last snapshot follows.
                let ended = match tracer.reap_command().and(tracer.command_ended.as_deref()) {
                    Some(how) => format!("the command {how}"),
                    None => match tracer.target_pid {
                        Some(pid) => format!("pid {pid} exited"),
                        None => "the traced process exited".into(),
                    },
                };
                eprintln!("memtrace: {ended}");
                true
            }
            Wake::Signal(_) => true,
            _ => false,
        };
        // At the end, every ring is read dry before the last snapshot (a drain takes a
        // bounded share of each ring's stacks: 128 KiB of a ring's with 16 rings or more,
        // so 256 drains read 32 MiB of each).
        for _ in 0..256 {
            tracer.drain(live, finished);
            if !finished || tracer.caught_up() {
                break;
            }
        }
        tracer.housekeeping();
        live.allocator_families = tracer.allocators.iter().map(|a| a.family.name()).collect();
        if finished || last.elapsed() >= opts.interval {
            let lost = tracer.probes.counters().map(|c| c.lost_events).unwrap_or(0);
            let snap = live.snapshot(&opts.view, last.elapsed(), lost);
            last = Instant::now();
            if matches!(layout.columns, ColumnChoice::Fit) {
                layout.columns = ColumnChoice::Listed(fitted_columns(&snap, &opts.view, opts.rows, &layout));
            }
            let text =
                render_batch(&snap, &format!("{title} — snapshot {}", printed + 1), &opts.view, opts.rows, &layout);
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
