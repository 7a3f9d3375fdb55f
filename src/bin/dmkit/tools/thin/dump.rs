//! `thin_dump`, `thin_restore`, `thin_repair`.

use super::{
    open_input, open_output, quietly, req, stat, DumpArgs, Failure, Format, Outcome, RepairArgs, RestoreArgs,
};
use dmkit::pdata::tm::reader;
use dmkit::thin::dump::{dump_with, write_plan, DumpFormat, DumpOptions, Source};
use dmkit::thin::ir::Overrides;
use dmkit::thin::repair::salvage;
use dmkit::thin::restore::Restorer;
use dmkit::thin::{xml, ThinError};
use std::path::Path;

/// A failure: silent if the output pipe closed or -q, else its message.
fn fail(e: ThinError, quiet: bool) -> Failure {
    let pipe = matches!(&e, ThinError::Output(io) if super::broken_pipe(io));
    if pipe || quiet {
        Failure::Quiet(super::EXIT_FAILURE)
    } else {
        Failure::Message(e.to_string())
    }
}

pub fn run_dump(a: DumpArgs) -> Outcome {
    let q = a.quiet;
    quietly(dump(a), q)
}

fn dump(a: DumpArgs) -> Outcome {
    let dev = open_input(&req(a.input.clone()), false)?;
    let o = DumpOptions {
        source: match a.metadata_snap {
            None => Source::Live,
            Some(None) => Source::HeldSnapshot,
            Some(Some(b)) => Source::SnapshotAt(b),
        },
        skip_mappings: a.skip_mappings,
        dev_ids: (!a.dev_id.is_empty()).then(|| a.dev_id.clone()),
        format: match a.format {
            Format::Xml => DumpFormat::Xml,
            Format::HumanReadable => DumpFormat::HumanReadable,
        },
        overrides: Overrides {
            transaction_id: a.transaction_id,
            data_block_size: a.data_block_size,
            nr_data_blocks: a.nr_data_blocks,
        },
        repair: a.repair,
        progress: !a.quiet,
    };
    let warnings = match &a.output {
        Some(p) => {
            let f = std::fs::File::create(p).map_err(|e| Failure::Message(format!("output error: {e}")))?;
            let mut w = std::io::BufWriter::new(f);
            dump_with(Box::new(dev), &o, &mut w).map_err(|e| fail(e, a.quiet))?
        }
        None => {
            let stdout = std::io::stdout();
            let mut w = std::io::BufWriter::with_capacity(1 << 16, stdout.lock());
            dump_with(Box::new(dev), &o, &mut w).map_err(|e| fail(e, a.quiet))?
        }
    };
    if !a.quiet {
        for w in warnings {
            eprintln!("{w}");
        }
    }
    Ok(())
}

fn overrides(o: &super::Overrides) -> Overrides {
    Overrides {
        transaction_id: o.transaction_id,
        data_block_size: o.data_block_size,
        nr_data_blocks: o.nr_data_blocks,
    }
}

pub fn run_restore(a: RestoreArgs) -> Outcome {
    let q = a.io.quiet;
    quietly(restore_cmd(a.io), q)
}

fn restore_cmd(a: super::InOut) -> Outcome {
    let input = req(a.input);
    let output = req(a.output);
    if !stat(&input, "input")?.is_file() {
        return Err(Failure::Message(format!(
            "Not a block device or regular file '{}'.",
            input.display()
        )));
    }
    let dev = open_output(&output)?;
    let f = std::fs::File::open(&input).map_err(|e| Failure::Message(format!("{}: {e}", input.display())))?;
    let mut r = Restorer::new(Box::new(dev), overrides(&a.overrides), !a.quiet);
    xml::parse_into(std::io::BufReader::with_capacity(1 << 20, f), &mut r)
        .map_err(|e| Failure::Message(format!("{}: {e}", input.display())))?;
    r.finish()?;
    Ok(())
}

pub fn run_repair(a: RepairArgs) -> Outcome {
    let q = a.io.quiet;
    quietly(repair_cmd(a.io), q)
}

fn repair_cmd(a: super::InOut) -> Outcome {
    let input = req(a.input);
    let output = req(a.output);
    let dev = open_input(&input, false)?;
    let out = open_output(&output)?;
    if same_file(&input, &output) {
        return Err(Failure::Message(
            "the input and the output are the same file: repair into a new one".into(),
        ));
    }
    // the salvaged pool goes straight from the damaged one into the new one
    let o = DumpOptions {
        repair: true,
        overrides: overrides(&a.overrides),
        ..DumpOptions::default()
    };
    let mut tm = reader(Box::new(dev), 1024);
    let found = salvage(&mut tm, &o.overrides)?;
    let mut r = Restorer::new(Box::new(out), Overrides::default(), !a.quiet);
    write_plan(&mut tm, &found.plan, &o, &mut r)?;
    r.finish()?;
    if !a.quiet {
        for w in found.warnings {
            eprintln!("{w}");
        }
    }
    Ok(())
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}
