//! `memtrace top`: a live view of allocations, refreshed every interval — full-screen with
//! ratatui (sort, domain, grouping, filter, pause, expand a row's stack), or `-b` batch
//! snapshots on stdout for scripts and logs. The terminal is restored on quit, Ctrl-C,
//! SIGTERM, errors and panics.
//!
//! - [`model`]: the session sink and the snapshots (what is shown);
//! - [`table`]: the summary and the columns both views show, fitted to a width;
//! - [`tui`]: the full-screen view and its keys;
//! - [`batch`]: the text snapshots.
pub mod batch;
pub mod model;
pub mod table;
#[cfg(test)]
mod tests;
pub mod tui;

use std::time::Duration;

use anyhow::Result;

use self::model::{Column, LiveView, ViewOptions};
use crate::{
    columns::Layout,
    session::{TraceOptions, Tracer, block_on},
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
    /// Columns shown, and the width of batch snapshots (the full-screen view fits the
    /// screen).
    pub layout: Layout<Column>,
    /// The allocation wrappers a site is named past (`--alloc-fn`).
    pub alloc_fns: crate::wrappers::AllocFns,
}

const DRAIN_INTERVAL: Duration = Duration::from_millis(20);

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

pub fn run(mut opts: TopOptions) -> Result<i32> {
    use std::io::IsTerminal as _;
    if !opts.batch && !std::io::stdout().is_terminal() {
        // Written to a file or a pipe: the snapshots as text, as `-b` writes them.
        eprintln!("memtrace: top's output is not a terminal: text snapshots, as with -b");
        opts.batch = true;
    }
    if !opts.batch && std::fs::OpenOptions::new().read(true).write(true).open("/dev/tty").is_err() {
        anyhow::bail!("top's full-screen view needs a terminal, and this process has none: -b prints text snapshots");
    }
    let mut trace = opts.trace.clone();
    // The view owns the screen: the session's own messages would garble it.
    trace.quiet = trace.quiet || !opts.batch;
    let mut tracer = Tracer::start(&trace, |_| Ok(()))?;
    let mut live = LiveView::new(opts.live_limit, trace.sample_bytes, tracer.target_pid);
    live.set_alloc_fns(opts.alloc_fns.clone());
    tracer.release()?;
    let result = if opts.batch {
        block_on(batch::batch(&mut tracer, &mut live, &opts))?
    } else {
        block_on(tui::interactive(&mut tracer, &mut live, &opts))?
    };
    // `-n`'s last snapshot, or the view closed, with the command still running: it ends
    // with the view, and says so.
    if let Some(how) = tracer.end_command() {
        eprintln!("memtrace: the command was still running when top stopped: {how}");
    }
    let (teardown, _) = tracer.stop(&mut live);
    teardown.join();
    result
}
