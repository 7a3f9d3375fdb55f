//! The state file: the daemon's devices as the control requests that make them
//! again, rewritten after every change, replayed by `dmkit serve --restore`.
//!
//! One argument per line, a blank line after each request. Tables are what
//! `table` prints, with dmkit devices named by path instead of by minor (a
//! restored device may get another minor). Pools, caches and snapshots keep
//! their own state in their metadata; the file holds only what the kernel's
//! device-mapper would lose at a reboot: which tables are loaded, and which
//! device is attached as which ublk block device.

use super::{verbs, Ctx};
use crate::mapper::DM_MAJOR;
use clap::Parser;
use std::io::Write;
use std::path::Path;

/// The requests that make the daemon's devices again, in order.
pub fn requests(ctx: &Ctx) -> Vec<Vec<String>> {
    let devs = ctx.reg.creation_order();
    let by_minor: std::collections::HashMap<String, String> = devs
        .iter()
        .map(|d| {
            (
                format!("{DM_MAJOR}:{}", d.minor),
                format!("/dev/mapper/{}", crate::table::escape(&d.name())),
            )
        })
        .collect();
    let mut out = Vec::new();
    for d in &devs {
        let name = d.name();
        let mut req = vec!["create".to_string(), name.clone()];
        if let Some(u) = d.uuid() {
            req.extend(["--uuid".to_string(), u]);
        }
        if d.read_only {
            req.push("--readonly".into());
        }
        // words are split on single spaces: an escaped path keeps its `\ `
        let by_path = |line: &str| -> String {
            line.split(' ')
                .map(|w| by_minor.get(w).map_or(w, String::as_str))
                .collect::<Vec<_>>()
                .join(" ")
        };
        match ctx.reg.table_lines(Some(&name), false, false) {
            Ok(t) if !t.trim().is_empty() => {
                for line in t.lines() {
                    req.extend(["--table".to_string(), by_path(line)]);
                }
            }
            _ => req.push("--notable".into()),
        }
        out.push(req);
        // state messages set that the table does not show
        if let Some(t) = d.live.load_full() {
            for e in &t.entries {
                for m in e.target.replay_messages() {
                    out.push(vec!["message".into(), name.clone(), e.start.to_string(), m]);
                }
            }
        }
        // a table loaded and not yet resumed
        if let Ok(t) = ctx.reg.table_lines(Some(&name), false, true) {
            if !t.trim().is_empty() {
                let mut load = vec!["load".to_string(), name.clone()];
                for line in t.lines() {
                    load.extend(["--table".to_string(), by_path(line)]);
                }
                out.push(load);
            }
        }
    }
    for (d, id) in ctx.ublk.ids() {
        out.push(vec![
            "attach".into(),
            d.name(),
            "--recover".into(),
            id.to_string(),
        ]);
    }
    out
}

/// This boot of the machine (tables name block devices by number, which a
/// reboot may give to other disks).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

const BOOT: &str = "# boot ";

/// Write the state file (a new file renamed over the old one).
pub fn save(ctx: &Ctx, path: &Path) -> std::io::Result<()> {
    let mut text = String::from("# dmkit's devices: `dmkit serve --restore` makes them again\n");
    text.push_str(&format!("{BOOT}{}\n\n", boot_id()));
    for req in requests(ctx) {
        for a in req {
            text.push_str(&a);
            text.push('\n');
        }
        text.push('\n');
    }
    let tmp = path.with_extension("new");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Where a record that is not replayed is kept.
pub fn prev_path(path: &Path) -> std::path::PathBuf {
    path.with_extension("prev")
}

/// Move the record at `path` aside, unreplayed; where it went.
pub fn set_aside(path: &Path) -> std::io::Result<std::path::PathBuf> {
    let prev = prev_path(path);
    std::fs::rename(path, &prev)?;
    Ok(prev)
}

/// Parse a state file into its requests.
pub fn parse(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut cur: Vec<String> = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        if line.is_empty() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(line.to_string());
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Replay the state file: each request that fails is reported and the rest go
/// on. A device that cannot be made again is reported by name, the requests
/// about it are skipped, and the block device it was attached as is failed
/// (stopped: its filesystem gets errors instead of waiting for a server that
/// will not come). The file is then rewritten from what is there; if anything
/// failed, the old one is kept beside it as `.prev`. The number of devices made
/// again, and the errors.
pub fn restore(ctx: &Ctx, path: &Path) -> std::io::Result<(usize, Vec<String>)> {
    let text = std::fs::read_to_string(path)?;
    let mut devices = 0;
    let mut lost: Vec<String> = Vec::new();
    let mut errors = Vec::new();
    let recorded = text.lines().find_map(|l| l.strip_prefix(BOOT)).unwrap_or("");
    if recorded != boot_id() {
        // after a reboot the numbers in the tables may name other disks, and the
        // block devices are gone: nothing is replayed
        let prev = set_aside(path)?;
        errors.push(format!(
            "{} was written before the machine rebooted: not replayed (kept as {})",
            path.display(),
            prev.display()
        ));
        return Ok((0, errors));
    }
    for req in parse(&text) {
        let verb = req.first().map_or("", String::as_str);
        let name = req.get(1).map_or("", String::as_str).to_string();
        let recover = (verb == "attach")
            .then(|| req.iter().skip_while(|a| *a != "--recover").nth(1))
            .flatten()
            .and_then(|id| id.parse::<u32>().ok());
        if verb != "create" && lost.contains(&name) {
            if let Some(id) = recover {
                errors.push(fail_block_device(ctx, &name, id));
            }
            continue;
        }
        let r = super::Request::try_parse_from(&req)
            .map_err(|e| verbs::one_line(&e, "dmkit").unwrap_or_else(|| e.to_string()))
            .and_then(|r| super::run_verb(ctx, r.verb, ""));
        match (verb, r) {
            ("create", Ok(_)) => devices += 1,
            ("create", Err(e)) => {
                errors.push(format!("device '{name}' not restored: {e}"));
                lost.push(name);
            }
            (_, Ok(_)) => {}
            (_, Err(e)) => errors.push(format!("device '{name}': {verb} not replayed: {e}")),
        }
    }
    if !errors.is_empty() {
        std::fs::copy(path, prev_path(path))?;
    }
    save(ctx, path)?;
    Ok((devices, errors))
}

/// The block device `id` that device `name` was attached as, whose device is
/// lost: stopped, so what waits on it fails. What happened, as a line.
fn fail_block_device(ctx: &Ctx, name: &str, id: u32) -> String {
    match ctx.ublk.fail(id) {
        Ok(()) => format!(
            "device '{name}': its block device /dev/ublkb{id} was stopped (its I/O fails; unmount it)"
        ),
        Err(e) => format!("device '{name}': its block device /dev/ublkb{id} could not be stopped: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Ctx {
        use crate::mapper::registry::{Config, Registry};
        Ctx::sandboxed(std::sync::Arc::new(Registry::new(Config {
            target_types: crate::targets::types(),
            ..Config::default()
        })))
    }

    #[test]
    fn a_record_is_replayed_in_the_same_boot_only() {
        let dir = std::env::temp_dir().join(format!("dmkit-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("devices.state");
        let record = "create\nz\n--table\n0 8 zero\n\n";

        std::fs::write(&path, format!("{BOOT}{}\n\n{record}", boot_id())).expect("write");
        let c = ctx();
        assert_eq!(restore(&c, &path).expect("restore"), (1, vec![]));
        assert!(c.reg.get("z").is_ok());
        // as `table` prints it: a space after a target without arguments, as dmsetup's
        assert_eq!(requests(&c), vec![vec!["create", "z", "--table", "0 8 zero "]]);

        std::fs::write(&path, format!("{BOOT}another-boot\n\n{record}")).expect("write");
        let c = ctx();
        let (ok, errors) = restore(&c, &path).expect("restore");
        assert_eq!(ok, 0);
        assert!(errors[0].contains("before the machine rebooted"), "{errors:?}");
        assert!(c.reg.get("z").is_err(), "nothing replayed");
        assert!(prev_path(&path).exists() && !path.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn parse_splits_requests_on_blank_lines() {
        let t = "# c\n\ncreate\na\n--table\n0 8 zero\n\nattach\na\n--recover\n3\n\n";
        assert_eq!(
            parse(t),
            vec![
                vec!["create", "a", "--table", "0 8 zero"],
                vec!["attach", "a", "--recover", "3"]
            ]
        );
    }
}
