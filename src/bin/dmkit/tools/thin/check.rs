//! `thin_check`.

use super::{open_input, quietly, req, CheckArgs, Failure, Outcome};
use dmkit::thin::check::{check_with, CheckOptions, Line, Report};
use std::io::Write;

pub fn run(a: CheckArgs) -> Outcome {
    let q = a.quiet;
    quietly(check(a), q)
}

fn check(a: CheckArgs) -> Outcome {
    let input = req(a.input);
    let o = CheckOptions {
        metadata_snap: a.metadata_snap,
        super_block_only: a.super_block_only,
        skip_mappings: a.skip_mappings,
        ignore_non_fatal: a.ignore_non_fatal_errors,
        auto_repair: a.auto_repair,
        clear_needs_check: a.clear_needs_check_flag,
        override_mapping_root: a.override_mapping_root,
        override_details_root: a.override_details_root,
        progress: !a.quiet,
    };
    let dev = open_input(&input, a.auto_repair || a.clear_needs_check_flag)?;
    let r = check_with(Box::new(dev), o);
    if !a.quiet {
        print_report(&r, a.super_block_only, a.ignore_non_fatal_errors);
    }
    if r.passed(a.ignore_non_fatal_errors) {
        Ok(())
    } else {
        Err(Failure::Quiet(super::EXIT_FAILURE))
    }
}

/// What thin_check prints of a check (thin_trim prints it too, as 1.x does).
pub(super) fn print_report(r: &Report, super_block_only: bool, ignore_non_fatal: bool) {
    {
        if let Some((tid, free)) = r.info {
            // a closed standard output loses these lines, nothing else
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "TRANSACTION_ID={tid}");
            let _ = writeln!(out, "METADATA_FREE_BLOCKS={free}");
            let _ = out.flush();
        }
        // 1.x gives no progress titles to a superblock-only check
        if (r.info.is_some() || r.fatal.is_none()) && !super_block_only {
            eprintln!("Checking thin metadata");
        }
        for l in &r.lines {
            match l {
                Line::Title(s) | Line::Msg(s) => eprintln!("{s}"),
            }
        }
        if let Some(f) = &r.fatal {
            eprintln!("{f}");
        } else if let (Some(n), false) = (&r.non_fatal, ignore_non_fatal) {
            eprintln!("{n}");
        }
    }
}
