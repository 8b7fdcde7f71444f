//! memtrace's diagnostics on stderr, off unless asked for: `MEMTRACE_LOG=debug` (or
//! `error`, `warn`, `info`, `trace`) prints what the `log` macros say — which attach path
//! was used, which unwind tables were built or found in the cache, and why an entry was
//! rebuilt. Each line carries the milliseconds since the logger started (`+123.4ms`), so
//! a debug log is also a timeline of the start and the stop.
use std::{sync::OnceLock, time::Instant};

use log::{LevelFilter, Log, Metadata, Record};

struct Stderr;

/// When the logger was installed: the origin of each line's timestamp.
static STARTED: OnceLock<Instant> = OnceLock::new();

impl Log for Stderr {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        // Other crates (aya's loader is chatty) only for warnings and errors.
        let ours = metadata.target().starts_with("memtrace");
        metadata.level() <= log::max_level() && (ours || metadata.level() <= log::Level::Warn)
    }

    fn log(&self, record: &Record<'_>) {
        if self.enabled(record.metadata()) {
            let ms = STARTED.get().map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
            eprintln!("memtrace: {}: +{ms:.1}ms: {}", record.level().as_str().to_ascii_lowercase(), record.args());
        }
    }

    fn flush(&self) {}
}

/// The level `MEMTRACE_LOG` asks for (off when unset or unknown).
pub fn level_from_env(value: Option<&str>) -> LevelFilter {
    value.and_then(|v| v.trim().parse().ok()).unwrap_or(LevelFilter::Off)
}

/// Installs the logger once; later calls do nothing.
pub fn init() {
    static LOGGER: Stderr = Stderr;
    if log::set_logger(&LOGGER).is_ok() {
        STARTED.get_or_init(Instant::now);
        log::set_max_level(level_from_env(std::env::var("MEMTRACE_LOG").ok().as_deref()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_level_comes_from_the_environment_and_defaults_to_off() {
        assert_eq!(level_from_env(None), LevelFilter::Off);
        assert_eq!(level_from_env(Some("debug")), LevelFilter::Debug);
        assert_eq!(level_from_env(Some("WARN")), LevelFilter::Warn);
        assert_eq!(level_from_env(Some("loud")), LevelFilter::Off);
    }
}
