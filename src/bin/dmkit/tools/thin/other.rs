//! `thin_rmap`, `thin_trim`, `thin_delta`, `thin_ls`: the library's read-only
//! views (dmkit::thin::{rmap, trim, delta, ls}) on a file, or on a live pool
//! through the daemon.

use super::live::{ask_daemon, live_pool};
use super::{emit, open_input, req, DeltaArgs, Failure, LsArgs, Outcome, RmapArgs, TrimArgs};
use dmkit::pdata::tm::reader;
use dmkit::pdata::tm::TransactionManager;
use dmkit::thin::delta::{delta_text, DeltaOptions, Side};
use dmkit::thin::ls::{ls_text, LsOptions};
use dmkit::thin::online::Request;
use dmkit::thin::rmap::rmap;
use std::path::Path;

/// Open metadata for reading, with 1.x's input checks.
fn open(p: &Path) -> Result<TransactionManager, Failure> {
    Ok(reader(Box::new(open_input(p, false)?), 256))
}

pub fn run_rmap(a: RmapArgs) -> Outcome {
    let mut tm = open(&req(a.input))?;
    let s: String = rmap(&mut tm, &a.region)?
        .iter()
        .map(|r| format!("{r}\n"))
        .collect();
    emit(&s)
}

pub fn run_trim(a: TrimArgs) -> Outcome {
    let meta = req(a.metadata_dev);
    let data = req(a.data_dev);
    // trim discards what the metadata calls free: a live pool's metadata moves
    // under it, so both its files are claimed as a pool holds them
    let dev = open_input(&meta, false)?;
    let _claims = [super::claim(&meta)?, super::claim(&data)?];
    // a second handle for the pool once the check (which takes the first) passed
    let again = dmkit::pdata::MetadataDev::try_clone(&dev)
        .ok_or_else(|| Failure::Message(format!("{}: cannot open it twice", meta.display())))?;
    let r = dmkit::thin::check::check_with(Box::new(dev), dmkit::thin::check::CheckOptions::default());
    if !a.quiet && r.passed(false) {
        // 1.x's thin_trim reports its check as thin_check does
        super::check::print_report(&r, false, false);
    }
    if !r.passed(false) {
        if !a.quiet {
            eprintln!("metadata contains errors (run thin_check for details).\nperhaps you need to run thin_repair.");
        }
        return Err(Failure::Quiet(65));
    }
    let md = dmkit::thin::ThinPoolMetadata::open(again, 1024)?;
    dmkit::thin::trim::discard_free(&md, &data)?;
    Ok(())
}

pub fn run_delta(a: DeltaArgs) -> Outcome {
    let input = req(a.input.clone());
    // clap lets one of --thinN and --rootN through
    let side = |thin: Option<u64>, root: Option<u64>| thin.map(Side::Thin).or(root.map(Side::Root));
    let o = DeltaOptions {
        left: side(a.thin1, a.root1),
        right: side(a.thin2, a.root2),
        verbose: a.verbose,
        metadata_snap: a.metadata_snap,
    };
    if let Some(pool) = live_pool(&input) {
        return ask_daemon(pool, &Request::Delta(o));
    }
    let mut tm = open(&input)?;
    emit(&delta_text(&mut tm, &o)?)
}

pub fn run_ls(a: LsArgs) -> Outcome {
    let input = req(a.input.clone());
    let o = LsOptions {
        fields: a.format.clone(),
        no_headers: a.no_headers,
        metadata_snap: a.metadata_snap,
    };
    if let Some(pool) = live_pool(&input) {
        return ask_daemon(pool, &Request::Ls(o));
    }
    let mut tm = open(&input)?;
    if o.counts() {
        eprintln!("Scanning data mappings");
    }
    emit(&ls_text(&mut tm, &o)?)
}
