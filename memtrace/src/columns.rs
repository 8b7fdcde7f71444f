//! Tables that fit the terminal, like `ps`, `perf report` and `htop`: the terminal's width,
//! which columns to keep (numbers are never cut: a column is dropped instead, lowest
//! priority first), and the name column last, taking the rest of the line and ellipsized
//! with a minimum width. `report`'s text and `top -b` render through [`TextTable`]; `top`'s
//! full-screen view uses [`fit`] with ratatui.

/// The name column (SITE, FUNCTION, PROCESS) is never narrower than this.
pub const NAME_MIN_WIDTH: usize = 24;

/// Room the default choice of columns leaves for the names before it adds a figure
/// (`--wide` in the full-screen view leaves only [`NAME_MIN_WIDTH`]).
pub const NAME_FIT_WIDTH: usize = 32;

/// Width used when standard output is not a terminal and `COLUMNS` is not set.
pub const DEFAULT_WIDTH: usize = 80;

/// How wide output may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Width {
    Columns(usize),
    /// `--wide`: lines as long as their contents.
    Unlimited,
}

/// Which of a table's columns to show.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ColumnChoice<C> {
    /// As many as fit, by priority.
    #[default]
    Fit,
    /// Every column (`--wide`).
    All,
    /// These, in this order (`--fields`).
    Listed(Vec<C>),
}

/// How a table is laid out: its width and its columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout<C> {
    pub width: Width,
    pub columns: ColumnChoice<C>,
}

impl<C> Default for Layout<C> {
    fn default() -> Self {
        Self { width: Width::Columns(DEFAULT_WIDTH), columns: ColumnChoice::Fit }
    }
}

impl<C> Layout<C> {
    /// What `--wide` and `--fields` ask for: `--wide` lifts the width limit and shows every
    /// column (or the listed ones); without it, output fits the terminal.
    pub fn from_flags(wide: bool, fields: Vec<C>) -> Self {
        let width = if wide { Width::Unlimited } else { Width::Columns(terminal_width()) };
        let columns = match (fields.is_empty(), wide) {
            (false, _) => ColumnChoice::Listed(fields),
            (true, true) => ColumnChoice::All,
            (true, false) => ColumnChoice::Fit,
        };
        Self { width, columns }
    }

    /// The columns to consider, in display order, out of `all` (in display order).
    pub fn candidates(&self, all: &[C]) -> Vec<C>
    where
        C: Copy + PartialEq,
    {
        match &self.columns {
            ColumnChoice::Listed(list) => {
                let mut out: Vec<C> = Vec::with_capacity(list.len());
                for c in list {
                    if !out.contains(c) {
                        out.push(*c);
                    }
                }
                out
            }
            ColumnChoice::Fit | ColumnChoice::All => all.to_vec(),
        }
    }
}

/// The terminal's width: `COLUMNS` if set, else standard output's window size, else
/// [`DEFAULT_WIDTH`].
pub fn terminal_width() -> usize {
    if let Some(n) = std::env::var("COLUMNS").ok().and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0) {
        return n;
    }
    let mut size = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: isatty has no preconditions; TIOCGWINSZ fills the winsize passed, which
    // outlives the call.
    let ok = unsafe {
        libc::isatty(libc::STDOUT_FILENO) == 1 && libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut size) == 0
    };
    if ok && size.ws_col > 0 { usize::from(size.ws_col) } else { DEFAULT_WIDTH }
}

/// Which columns to keep, as indices in display order: in order of `ranks` (0 first), each
/// column is kept if it still fits in `budget`, costing its width plus `spacing`.
pub fn fit(widths: &[usize], ranks: &[usize], spacing: usize, budget: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..widths.len()).collect();
    order.sort_by_key(|&i| (ranks[i], i));
    let mut used = 0;
    let mut kept = Vec::new();
    for i in order {
        let cost = widths[i] + spacing;
        if used + cost <= budget {
            used += cost;
            kept.push(i);
        }
    }
    kept.sort_unstable();
    kept
}

/// Display width of a cell (one column per character: names and units are not wide).
pub fn width_of(s: &str) -> usize {
    s.chars().count()
}

/// `s` in at most `width` columns, ending in `…` when cut.
pub fn ellipsize(s: &str, width: usize) -> String {
    if width_of(s) <= width {
        return s.to_string();
    }
    let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// A right-aligned column of figures.
#[derive(Debug, Clone)]
pub struct TextColumn {
    pub header: String,
    pub cells: Vec<String>,
    /// Priority: 0 is kept first.
    pub rank: usize,
}

impl TextColumn {
    pub fn new(header: impl Into<String>, rank: usize, cells: Vec<String>) -> Self {
        Self { header: header.into(), cells, rank }
    }

    fn width(&self) -> usize {
        self.cells.iter().map(|c| width_of(c)).chain([width_of(&self.header)]).max().unwrap_or(0)
    }
}

/// Separator between columns in text output.
const GAP: &str = "  ";

/// Right-aligned figures, then optionally a left-aligned name column that takes the rest.
#[derive(Debug, Clone, Default)]
pub struct TextTable {
    pub columns: Vec<TextColumn>,
    /// The last column: header and one name per row.
    pub names: Option<(String, Vec<String>)>,
    /// Keep every column even when the line overflows (the user listed them).
    pub keep_all: bool,
}

impl TextTable {
    /// The table as lines (no trailing spaces), header first.
    /// The columns that fit `width` (indices, in order).
    pub fn kept(&self, width: Width) -> Vec<usize> {
        self.kept_at_least(width, &[])
    }

    /// [`Self::kept`], each column counted at least `floors[i]` wide (the width its figures
    /// may need later).
    pub fn kept_at_least(&self, width: Width, floors: &[usize]) -> Vec<usize> {
        let widths: Vec<usize> =
            self.columns.iter().enumerate().map(|(i, c)| c.width().max(floors.get(i).copied().unwrap_or(0))).collect();
        let names_width = self
            .names
            .as_ref()
            .map(|(h, names)| names.iter().map(|n| width_of(n)).chain([width_of(h)]).max().unwrap_or(0));
        match width {
            Width::Columns(w) if !self.keep_all => {
                // Room for the names: their own width, up to a comfortable one.
                let reserve = names_width.map_or(0, |n| n.min(NAME_FIT_WIDTH));
                let ranks: Vec<usize> = self.columns.iter().map(|c| c.rank).collect();
                fit(&widths, &ranks, GAP.len(), w.saturating_sub(reserve))
            }
            _ => (0..self.columns.len()).collect(),
        }
    }

    pub fn lines(&self, width: Width) -> Vec<String> {
        let widths: Vec<usize> = self.columns.iter().map(TextColumn::width).collect();
        let kept = self.kept(width);
        let used: usize = kept.iter().map(|&i| widths[i] + GAP.len()).sum();
        let name_room = match width {
            Width::Columns(w) => Some(w.saturating_sub(used).max(NAME_MIN_WIDTH)),
            Width::Unlimited => None,
        };
        let rows = self.columns.first().map_or_else(|| self.names.as_ref().map_or(0, |n| n.1.len()), |c| c.cells.len());
        let line = |cells: &mut dyn Iterator<Item = (usize, &str)>, name: Option<&str>| -> String {
            let mut l = String::new();
            for (i, c) in cells {
                l.push_str(&" ".repeat(widths[i].saturating_sub(width_of(c))));
                l.push_str(c);
                l.push_str(GAP);
            }
            if let Some(name) = name {
                match name_room {
                    Some(room) => l.push_str(&ellipsize(name, room)),
                    None => l.push_str(name),
                }
            }
            l.truncate(l.trim_end().len());
            l
        };
        let mut out = Vec::with_capacity(rows + 1);
        out.push(line(
            &mut kept.iter().map(|&i| (i, self.columns[i].header.as_str())),
            self.names.as_ref().map(|(h, _)| h.as_str()),
        ));
        for r in 0..rows {
            out.push(line(
                &mut kept.iter().map(|&i| (i, self.columns[i].cells[r].as_str())),
                self.names.as_ref().map(|(_, n)| n[r].as_str()),
            ));
        }
        out
    }

    /// The table as text, one line per row, each ending in a newline.
    pub fn render(&self, width: Width) -> String {
        let mut out = String::new();
        for l in self.lines(width) {
            out.push_str(&l);
            out.push('\n');
        }
        out
    }
}

/// Words (items) flowed into lines of at most `width` columns, separated by two spaces;
/// an item longer than a line gets a line of its own. For summary lines that must not be
/// cut at the screen's edge.
pub fn flow(items: &[String], width: Width) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut current = String::new();
    for item in items {
        let fits = match width {
            Width::Unlimited => true,
            Width::Columns(w) => width_of(&current) + GAP.len() + width_of(item) <= w,
        };
        if current.is_empty() {
            current.push_str(item);
        } else if fits {
            current.push_str(GAP);
            current.push_str(item);
        } else {
            lines.push(std::mem::take(&mut current));
            current.push_str(item);
        }
    }
    if !current.is_empty() {
        lines.push(current);
    }
    lines
}

/// Prose wrapped at spaces into lines of at most `width` columns (a word longer than a line
/// gets a line of its own).
pub fn wrap(text: &str, width: Width) -> Vec<String> {
    let Width::Columns(w) = width else {
        return vec![text.to_string()];
    };
    let mut lines: Vec<String> = Vec::new();
    let mut current = String::new();
    for word in text.split(' ') {
        if !current.is_empty() && width_of(&current) + 1 + width_of(word) > w {
            lines.push(std::mem::take(&mut current));
        } else if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(word);
    }
    lines.push(current);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> TextTable {
        TextTable {
            columns: vec![
                TextColumn::new("", 0, vec!["U".into(), "K".into()]),
                TextColumn::new("ALLOCS", 2, vec!["1,000".into(), "20".into()]),
                TextColumn::new("BYTES", 1, vec!["1.0 MiB".into(), "96 B".into()]),
                TextColumn::new("FRAG", 3, vec!["9.1%".into(), "0.0%".into()]),
            ],
            names: Some((
                "SITE".into(),
                vec!["parse_request (app.c:42) ← serve (app.c:90) ← main (app.c:7)".into(), "kfree".into()],
            )),
            keep_all: false,
        }
    }

    #[test]
    fn wide_tables_keep_every_column_and_whole_names() {
        assert_eq!(
            table().render(Width::Unlimited),
            concat!(
                "   ALLOCS    BYTES  FRAG  SITE\n",
                "U   1,000  1.0 MiB  9.1%  parse_request (app.c:42) ← serve (app.c:90) ← main (app.c:7)\n",
                "K      20     96 B  0.0%  kfree\n",
            )
        );
    }

    #[test]
    fn narrow_tables_drop_the_lowest_priority_columns_and_ellipsize_names() {
        // 3 + 8 + 9 + 6 = 26 for the figures; 32 left for the names.
        let text = table().render(Width::Columns(58));
        assert_eq!(
            text,
            concat!(
                "   ALLOCS    BYTES  FRAG  SITE\n",
                "U   1,000  1.0 MiB  9.1%  parse_request (app.c:42) ← serv…\n",
                "K      20     96 B  0.0%  kfree\n",
            )
        );
        // FRAG goes first, then ALLOCS; the names keep their minimum.
        let text = table().render(Width::Columns(52));
        assert!(text.starts_with("   ALLOCS    BYTES  SITE\n"), "{text}");
        let text = table().render(Width::Columns(44));
        assert!(text.starts_with("     BYTES  SITE\n"), "{text}");
        for l in text.lines() {
            assert!(width_of(l) <= 44, "{l}");
        }
        // Past the point where nothing fits, the names keep their minimum.
        let text = table().render(Width::Columns(10));
        assert!(text.contains("\nparse_request (app.c:42…\n"), "{text}");
    }

    #[test]
    fn listed_columns_are_kept_even_past_the_width() {
        let mut t = table();
        t.keep_all = true;
        let text = t.render(Width::Columns(30));
        assert!(text.starts_with("   ALLOCS    BYTES  FRAG  SITE\n"), "{text}");
        assert!(text.contains("  parse_request (app.c:42…\n"), "names at their minimum: {text}");
    }

    #[test]
    fn fitting_goes_by_rank() {
        assert_eq!(fit(&[5, 5, 5], &[2, 0, 1], 1, 12), [1, 2]);
        assert_eq!(fit(&[5, 20, 5], &[0, 1, 2], 1, 12), [0, 2], "a wide column does not stop smaller ones");
        assert_eq!(fit(&[5], &[0], 1, 3), Vec::<usize>::new());
    }

    #[test]
    fn ellipsis_and_flow() {
        assert_eq!(ellipsize("abcdef", 6), "abcdef");
        assert_eq!(ellipsize("abcdef", 4), "abc…");
        let items: Vec<String> = ["allocs 1/s", "frees 2/s", "lost 0"].map(String::from).to_vec();
        assert_eq!(flow(&items, Width::Columns(80)), ["allocs 1/s  frees 2/s  lost 0"]);
        assert_eq!(flow(&items, Width::Columns(21)), ["allocs 1/s  frees 2/s", "lost 0"]);
        assert_eq!(flow(&items, Width::Columns(5)), ["allocs 1/s", "frees 2/s", "lost 0"]);
        assert_eq!(
            wrap("table full (50 blocks): 3 not followed", Width::Columns(24)),
            ["table full (50 blocks):", "3 not followed"]
        );
        assert_eq!(wrap("a b", Width::Unlimited), ["a b"]);
    }

    #[test]
    fn columns_env_sets_the_width() {
        // Only this test touches COLUMNS.
        // SAFETY: no other thread of the test binary reads or writes COLUMNS.
        unsafe { std::env::set_var("COLUMNS", "132") };
        assert_eq!(terminal_width(), 132);
        assert_eq!(
            Layout::<u8>::from_flags(false, vec![]),
            Layout { width: Width::Columns(132), columns: ColumnChoice::Fit }
        );
        unsafe { std::env::remove_var("COLUMNS") };
        assert_eq!(Layout::<u8>::from_flags(true, vec![]).columns, ColumnChoice::All);
        assert_eq!(Layout::from_flags(true, vec![3u8, 1, 3]).candidates(&[1, 2, 3]), [3, 1]);
    }
}
