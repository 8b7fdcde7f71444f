//! `report --format html`: one self-contained page.
use std::path::Path;

use anyhow::Result;

use super::ReportOptions;

pub fn render_html(_input: &Path, _opts: &ReportOptions) -> Result<String> {
    anyhow::bail!("not yet")
}
