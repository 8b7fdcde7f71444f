//! The HTML report in a real browser: Debian's Chromium (installed by `cargo xtask setup`),
//! headless, with no network at all (its own network namespace), loads the report from
//! disk. The DOM it builds must hold the memory charts with the peak marked, every flame
//! graph (drawn by inferno's own script in the page) and the leaking function's name; a
//! console message from the page or an error the page's hook caught fails the test. The
//! report and screenshots stay under target/tmp/html-report/ as artifacts.
mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use common::*;

fn chromium() -> PathBuf {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| Path::new(dir).join(name)).find(|p| p.exists())
        })
        .expect("no chromium: the HTML report is tested in a real browser; install it with `cargo xtask setup`")
}

/// Where the test keeps what it made.
fn artifacts() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("html-report");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The bundled workload recorded once, and its HTML reports: everything, and heap blocks
/// only (--kind malloc: no thread stacks, so the leaked blocks are the program's).
fn reports() -> &'static (PathBuf, PathBuf) {
    static REPORTS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    REPORTS.get_or_init(|| {
        require_root();
        let dir = scratch("html").until_exit();
        let data = dir.join("html.data");
        {
            let _sharing = sharing_the_machine();
            run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(workload()).args([
                "--threads",
                "2",
                "--iterations",
                "60",
                "--leaks",
                "5",
            ]));
        }
        let (all, heap) = (artifacts().join("report.html"), artifacts().join("report-heap.html"));
        run(memtrace().args(["report", "--format", "html", "--force", "-i"]).arg(&data).arg("-o").arg(&all));
        run(memtrace()
            .args(["report", "--format", "html", "--kind", "malloc", "--force", "-i"])
            .arg(&data)
            .arg("-o")
            .arg(&heap));
        (all, heap)
    })
}

/// Runs headless Chromium on `page` (with `fragment`) with `action` (`--dump-dom`,
/// `--screenshot=...`); returns its stdout. Fails on any console message from the report.
fn browse(page: &Path, fragment: &str, action: &str) -> String {
    let profile = tempdir_for("chromium-profile");
    let url = format!("file://{}{fragment}", page.display());
    // A network namespace of its own: no interface but a downed loopback.
    let out = Command::new("unshare")
        .arg("--net")
        .arg(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--window-size=1280,2000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(action)
        .arg(&url)
        .output()
        .expect("running chromium");
    // Chromium's profile says nothing of a failure: gone before anything is checked.
    let _ = std::fs::remove_dir_all(&profile);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "chromium failed ({}): {stderr}", out.status);
    // Console messages: Chromium logs them as `INFO:CONSOLE...] "message", source: URL`.
    // Those of the report (file://) or of its flame graphs (about:srcdoc) fail the test;
    // Chromium's own pages (chrome://) are not the report.
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .filter(|l| !l.contains("source: chrome://"))
        .collect();
    assert!(ours.is_empty(), "console messages from the report:\n{}", ours.join("\n"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn tempdir_for(name: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("memtrace-it-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The opening tag of the element with this id in the DOM.
fn tag<'a>(dom: &'a str, id: &str) -> &'a str {
    let at = dom.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no #{id} in the DOM"));
    let start = dom[..at].rfind('<').unwrap();
    &dom[start..start + dom[start..].find('>').unwrap() + 1]
}

/// An attribute of an opening tag.
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let at = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    Some(&tag[at..at + tag[at..].find('"')?])
}

/// The flame graph frame, after the page's script and inferno's ran: its view, domain,
/// how many frames inferno's script found drawn, and the SVG it shows.
fn flame(dom: &str) -> (String, String, usize, String) {
    let t = tag(dom, "flame");
    let frames = attr(t, "data-frames").unwrap_or_else(|| panic!("the flame graph never loaded: {t:.300}"));
    let srcdoc =
        attr(t, "srcdoc").unwrap_or_default().replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"");
    (attr(t, "data-view").unwrap().into(), attr(t, "data-domain").unwrap().into(), frames.parse().unwrap(), srcdoc)
}

fn assert_page_ok(dom: &str) {
    let body = tag(dom, "errors");
    assert!(attr(body, "hidden").is_some(), "the page caught errors: {body}");
    assert!(dom.contains("<body data-ready=\"1\">"), "the page's script ran to its end");
    assert!(!dom.contains("data-errors="), "errors counted by the page");
}

#[test]
fn the_report_renders_in_a_real_browser() {
    let (all, _) = reports();
    let html = std::fs::read_to_string(all).unwrap();
    assert!(html.len() < 4 << 20, "{} bytes", html.len());
    // Nothing to fetch: no attribute or style names another resource (the URLs in inferno's
    // comments and SVG namespaces are not fetched; the page's policy forbids it anyway).
    for attr in ["src=", "href=", "url(", "@import"] {
        for (i, _) in html.match_indices(attr) {
            let value: String =
                html[i + attr.len()..].chars().take(12).filter(|c| !matches!(c, '"' | '\\' | '\'')).collect();
            assert!(!value.starts_with("http") && !value.starts_with("//"), "{attr}{value}");
        }
    }
    assert!(html.contains("content=\"default-src 'none';"), "the page's policy");

    let dom = browse(all, "", "--dump-dom");
    assert_page_ok(&dom);
    // The charts: one per domain, drawn, the peak marked (reserved: the arenas glibc
    // reserves with PROT_NONE for the workload's threads).
    let charts: Vec<&str> = dom
        .match_indices("<figure class=\"chart\" data-domain=\"")
        .map(|(i, m)| dom[i + m.len()..].split('"').next().unwrap())
        .collect();
    assert_eq!(charts, ["user", "reserved", "kernel"], "a chart per domain");
    let user_chart = &dom[dom.find("<figure class=\"chart\" data-domain=\"user\"").unwrap()..];
    let user_chart = &user_chart[..user_chart.find("</figure>").unwrap()];
    assert!(
        user_chart.contains("<svg")
            && user_chart.contains("<polygon")
            && user_chart.contains("<circle")
            && user_chart.contains("\npeak "),
        "{user_chart:.500}"
    );
    // The default flame graph: user bytes, drawn by inferno in the page.
    let (view, domain, frames, svg) = flame(&dom);
    assert_eq!((view.as_str(), domain.as_str()), ("bytes", "user"));
    assert!(frames > 20, "{frames} frames drawn");
    assert!(svg.contains("wl_malloc_large") && svg.contains("exercise"), "{svg:.300}");
    // Every flame graph is in the page's data, for each domain.
    let data = &dom[dom.find("id=\"flamegraph-data\"").unwrap()..];
    for view in ["allocs", "bytes", "peak", "leaked"] {
        assert!(data.contains(&format!("\"{view}\":{{\"svgz\":")), "{view}");
    }
    // The leaking function, in the top sites.
    let sites = &dom[dom.find("<section id=\"sites\">").unwrap()..];
    assert!(
        sites[..sites.find("</section>").unwrap()].contains("wl_leak (alloc_workload.c:"),
        "the leaking site listed"
    );

    // The kernel switch and the peak tab.
    let dom = browse(all, "#flame=peak&domain=kernel", "--dump-dom");
    assert_page_ok(&dom);
    let (view, domain, frames, svg) = flame(&dom);
    assert_eq!((view.as_str(), domain.as_str()), ("peak", "kernel"));
    assert!(frames > 0 && svg.contains("at the kernel peak"), "{svg:.300}");
    assert!(dom.contains("data-domain=\"kernel\" aria-selected=\"true\""), "the kernel button is on");

    let shot = artifacts().join("report.png");
    let _ = std::fs::remove_file(&shot);
    browse(all, "", &format!("--screenshot={}", shot.display()));
    assert!(std::fs::metadata(&shot).map(|m| m.len() > 10_000).unwrap_or(false), "screenshot at {}", shot.display());
}

#[test]
fn the_leaked_flame_graph_shows_the_leak() {
    let (_, heap) = reports();
    let dom = browse(heap, "#flame=leaked&domain=user", "--dump-dom");
    assert_page_ok(&dom);
    let (view, _, frames, svg) = flame(&dom);
    assert_eq!(view, "leaked");
    assert!(frames > 0, "drawn");
    // 2 threads × 5 blocks of 77 bytes, under the thread that leaked them.
    assert!(svg.contains("wl_leak (770 bytes"), "{svg}");
    let shot = artifacts().join("report-leaked.png");
    let _ = std::fs::remove_file(&shot);
    browse(heap, "#flame=leaked&domain=user", &format!("--screenshot={}", shot.display()));
    assert!(shot.exists());
}

#[test]
fn a_console_error_fails_the_check() {
    // The check itself: a page whose script throws must not pass.
    let page = artifacts().join("broken.html");
    std::fs::write(&page, "<!DOCTYPE html><html><body><p>x</p><script>no_such_function();</script></body></html>")
        .unwrap();
    let caught = std::panic::catch_unwind(|| browse(&page, "", "--dump-dom"));
    let message = caught.expect_err("a thrown error was not noticed");
    let message = message.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("Uncaught ReferenceError: no_such_function"), "{message}");
}
