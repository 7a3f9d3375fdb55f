//! The state file: the daemon's devices as the control requests that make them
//! again, rewritten after every change, replayed by `dmkit serve --restore`.
//!
//! One argument per line, a blank line after each request. Tables are what
//! `table` prints, with dmkit devices named by path instead of by minor (the
//! tables are replayed by name); each device is made again with its own minor,
//! and the next minor to give is recorded, so a node made before a restart names
//! the same device after it. Pools, caches and snapshots keep
//! their own state in their metadata; the file holds only what the kernel's
//! device-mapper would lose at a reboot: which tables are loaded, and which
//! device is attached as which ublk block device or vhost-user socket. No key is ever written here:
//! a dm-crypt table is recorded with its key zeroed, and made again suspended
//! with the key wiped, waiting for it. The file is its owner's alone (mode 0600).

use super::{verbs, Ctx};
use crate::mapper::DevRef;
use crate::mapper::{Device, DM_MAJOR};
use crate::sync::Unpoison;
use clap::Parser;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// The requests that make the daemon's devices again, in order.
pub fn requests(ctx: &Ctx) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = ctx
        .reg
        .creation_order()
        .iter()
        .flat_map(|d| device_requests(ctx, d))
        .collect();
    out.extend(attach_requests(ctx).into_values());
    out
}

/// Each attached device's request that attaches it again: its ublk block
/// device taken over, or its vhost-user socket listened on.
fn attach_requests(ctx: &Ctx) -> std::collections::BTreeMap<String, Vec<String>> {
    let ublk = ctx.ublk.ids().into_iter().map(|(d, id)| {
        let name = d.name();
        (
            name.clone(),
            vec!["attach".into(), name, "--recover".into(), id.to_string()],
        )
    });
    let vhost = ctx.vhost.sockets().into_iter().map(|(d, socket)| {
        let name = d.name();
        let socket = socket.display().to_string();
        (
            name.clone(),
            vec!["attach".into(), name, "--vhost-user".into(), socket],
        )
    });
    ublk.chain(vhost).collect()
}

/// The requests that make device `d` again: `create` with its live table, the
/// messages that set state the table does not show, and `load` of a table
/// loaded and not yet resumed. Tables name other dmkit devices by path.
fn device_requests(ctx: &Ctx, d: &Arc<Device>) -> Vec<Vec<String>> {
    let name = d.name();
    // the dmkit devices this device's tables name, by the number `table` prints
    let live = d.live.load_full();
    let inactive = d.inactive.lock().unpoisoned().clone();
    let mut by_minor: Vec<(String, String)> = Vec::new();
    for t in live.iter().chain(inactive.iter()) {
        for e in &t.entries {
            for r in e.target.held_devices() {
                if let DevRef::Dm(h) = r {
                    by_minor.push((
                        format!("{DM_MAJOR}:{}", h.0.minor),
                        format!("/dev/mapper/{}", crate::table::escape(&h.0.name())),
                    ));
                }
            }
        }
    }
    // words are split on single spaces: an escaped path keeps its `\ `
    let by_path = |line: &str| -> String {
        line.split(' ')
            .map(|w| {
                by_minor
                    .iter()
                    .find(|(m, _)| m == w)
                    .map_or(w, |(_, p)| p.as_str())
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut out = Vec::new();
    let mut req = vec!["create".to_string(), name.clone()];
    if let Some(u) = d.uuid() {
        req.extend(["--uuid".to_string(), u]);
    }
    if d.read_only() {
        req.push("--readonly".into());
    }
    // every device keeps its number: nodes made before a restart still name it
    req.extend(["--minor".to_string(), d.minor.to_string()]);
    // keys are never written here: a table that holds one is recorded with it
    // zeroed, and the device is made again suspended with its key wiped, to
    // wait for it (`message NAME START key set HEX` and `resume`, or
    // `cryptsetup luksResume` behind the door), as after a `key wipe`
    match ctx.reg.table_lines(Some(&name), false, false, false) {
        Ok(t) if !t.trim().is_empty() => {
            for line in t.lines() {
                req.extend(["--table".to_string(), by_path(line)]);
            }
        }
        _ => req.push("--notable".into()),
    }
    out.push(req);
    let keyed: Vec<u64> = live
        .iter()
        .flat_map(|t| t.entries.iter())
        .filter(|e| e.target.table_params_keyless().is_some())
        .map(|e| e.start)
        .collect();
    if !keyed.is_empty() {
        out.push(vec!["suspend".into(), name.clone()]);
        for start in &keyed {
            out.push(vec![
                "message".into(),
                name.clone(),
                start.to_string(),
                "key".into(),
                "wipe".into(),
            ]);
        }
    }
    // state messages set that the table does not show
    if let Some(t) = &live {
        for e in &t.entries {
            for m in e.target.replay_messages() {
                out.push(vec!["message".into(), name.clone(), e.start.to_string(), m]);
            }
        }
    }
    // a table loaded and not yet resumed (not one with a key: it would resume
    // with a zeroed one; the load is lost, as a reboot loses it)
    let inactive_keyed = inactive
        .iter()
        .flat_map(|t| t.entries.iter())
        .any(|e| e.target.table_params_keyless().is_some());
    if let Ok(t) = ctx.reg.table_lines(Some(&name), false, true, false) {
        if !t.trim().is_empty() && !inactive_keyed {
            let mut load = vec!["load".to_string(), name.clone()];
            // its own mode, which the device takes at the resume
            if let Some(ro) = inactive.as_ref().map(|t| t.read_only) {
                load.push(if ro { "--readonly" } else { "--writable" }.to_string());
            }
            for line in t.lines() {
                load.extend(["--table".to_string(), by_path(line)]);
            }
            out.push(load);
        }
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
/// Where the search for a free minor goes on from (`Registry::next_minor`);
/// the last such line counts.
const NEXT_MINOR: &str = "# next-minor ";

fn push_requests(text: &mut String, reqs: &[Vec<String>]) {
    for req in reqs {
        for a in req {
            text.push_str(a);
            text.push('\n');
        }
        text.push('\n');
    }
}

/// Write the whole state file (a new file renamed over the old one); its size.
///
/// Not fsynced, here or in [`Recorder`]: the record is replayed only in the boot
/// that wrote it (tables name block devices by number, which a reboot may give
/// to other disks), and a daemon that dies leaves its writes in the page cache,
/// where the next daemon of the same boot reads them.
pub fn save(ctx: &Ctx, path: &Path) -> std::io::Result<u64> {
    let mut text = String::from("# dmkit's devices: `dmkit serve --restore` makes them again\n");
    text.push_str(&format!("{BOOT}{}\n", boot_id()));
    text.push_str(&format!("{NEXT_MINOR}{}\n\n", ctx.reg.next_minor()));
    push_requests(&mut text, &requests(ctx));
    let tmp = path.with_extension("new");
    // owner-only: tables hold dm-crypt keys, as the kernel's `table` prints them
    let mut f = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?
    };
    f.write_all(text.as_bytes())?;
    std::fs::rename(&tmp, path)?;
    Ok(text.len() as u64)
}

/// An entry appended to the state file: the requests that make device NAME
/// again replace the ones recorded for it before, up to the END line.
const SET: &str = "# set ";
/// An entry appended to the state file: device NAME is gone.
const DEL: &str = "# del ";
/// The last line of an entry; an entry without it (a daemon killed while
/// appending it, before the change was acknowledged) is not replayed.
const END: &str = "# end";
/// The appended entries may grow to the size of the whole record (or this, for a
/// small one) before the file is written whole again: each change costs what
/// its own devices' record does, however many devices there are.
const REWRITE_AFTER: u64 = 64 << 10;

/// Keeps the state file up to date after each change: the whole record at
/// first, then an entry per changed device appended, and the whole record again
/// once the entries are as large as it.
#[derive(Default)]
pub struct Recorder(std::sync::Mutex<Recorded>);

#[derive(Default)]
struct Recorded {
    /// The file holds a whole record written by this daemon.
    written: bool,
    /// Its size, and the bytes of entries appended since.
    base: u64,
    appended: u64,
    /// Devices attached when last recorded, and the requests that attach them.
    attached: std::collections::BTreeMap<String, Vec<String>>,
}

impl Recorder {
    /// Record what changed since the last call (everything with `all`).
    pub fn record(&self, ctx: &Ctx, path: &Path, all: bool) -> std::io::Result<()> {
        let mut st = self.0.lock().unpoisoned();
        let changed = ctx.reg.take_changed();
        let attached = attach_requests(ctx);
        let mut names = changed.names;
        for (n, req) in &attached {
            if st.attached.get(n) != Some(req) {
                names.insert(n.clone());
            }
        }
        names.extend(st.attached.keys().filter(|n| !attached.contains_key(*n)).cloned());
        st.attached = attached;
        if all || changed.all || !st.written || st.appended > st.base.max(REWRITE_AFTER) {
            st.written = false;
            st.base = save(ctx, path)?;
            st.appended = 0;
            st.written = true;
            return Ok(());
        }
        if names.is_empty() {
            return Ok(());
        }
        let mut text = format!("{NEXT_MINOR}{}\n", ctx.reg.next_minor());
        for name in &names {
            match ctx.reg.get(name) {
                Ok(d) => {
                    text.push_str(&format!("{SET}{name}\n"));
                    let mut reqs = device_requests(ctx, &d);
                    if let Some(req) = st.attached.get(name) {
                        reqs.push(req.clone());
                    }
                    push_requests(&mut text, &reqs);
                }
                Err(_) => text.push_str(&format!("{DEL}{name}\n")),
            }
            text.push_str(END);
            text.push('\n');
        }
        let appended = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(text.as_bytes()));
        if appended.is_err() {
            // write it whole next time
            st.written = false;
        }
        st.appended += text.len() as u64;
        appended
    }
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

/// Parse a state file into the requests to replay, in order: its whole record
/// with the entries appended since applied, each device after the devices its
/// tables name, the `attach` requests last.
pub fn parse(text: &str) -> Vec<Vec<String>> {
    let mut devices = ByDevice::new();
    // the entry being read: (device, set or del, its requests)
    let mut entry: Option<(String, bool, Vec<Req>)> = None;
    let mut cur: Req = Vec::new();
    // a request read whole goes to its entry, or (in the whole record) to its device
    let finish = |cur: &mut Req, entry: &mut Option<(String, bool, Vec<Req>)>, devices: &mut ByDevice| {
        if cur.is_empty() {
            return;
        }
        let req = std::mem::take(cur);
        match entry {
            Some((_, _, reqs)) => reqs.push(req),
            None => devices
                .entry(req.get(1).cloned().unwrap_or_default())
                .or_default()
                .push(req),
        }
    };
    for line in text.lines() {
        let set = line.strip_prefix(SET).map(|n| (n, true));
        if let Some((n, set)) = set.or_else(|| line.strip_prefix(DEL).map(|n| (n, false))) {
            finish(&mut cur, &mut entry, &mut devices);
            entry = Some((n.to_string(), set, Vec::new()));
        } else if line == END {
            finish(&mut cur, &mut entry, &mut devices);
            match entry.take() {
                Some((n, true, reqs)) => {
                    devices.insert(n, reqs);
                }
                Some((n, false, _)) => {
                    devices.remove(&n);
                }
                None => {}
            }
        } else if line.starts_with('#') {
            continue;
        } else if line.is_empty() {
            finish(&mut cur, &mut entry, &mut devices);
        } else {
            cur.push(line.to_string());
        }
    }
    if entry.is_none() {
        finish(&mut cur, &mut entry, &mut devices);
    }
    replay_order(devices)
}

/// One request: its words.
type Req = Vec<String>;
/// Each device's requests, by name.
type ByDevice = std::collections::BTreeMap<String, Vec<Req>>;

/// The devices' requests, each device after the ones its tables name
/// (`/dev/mapper/NAME` in a `--table` of its `create` or `load`), otherwise by
/// name; the `attach` requests last.
fn replay_order(devices: ByDevice) -> Vec<Req> {
    let names: Vec<&String> = devices.keys().collect();
    let index: std::collections::HashMap<&str, usize> =
        names.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
    let deps: Vec<Vec<usize>> = devices
        .values()
        .map(|reqs| {
            reqs.iter()
                .filter(|r| r.first().is_some_and(|v| v == "create" || v == "load"))
                .flat_map(|r| r.windows(2).filter(|w| w[0] == "--table").map(|w| w[1].as_str()))
                .flat_map(crate::table::split_args)
                .filter_map(|w| w.strip_prefix("/dev/mapper/").and_then(|n| index.get(n)).copied())
                .collect()
        })
        .collect();
    let order = crate::mapper::registry::deps_first(&deps);
    let all: Vec<&Vec<Req>> = devices.values().collect();
    let is_attach = |r: &Req| r.first().is_some_and(|v| v == "attach");
    let mut out: Vec<Req> = order
        .iter()
        .flat_map(|&i| all[i].iter().filter(|r| !is_attach(r)).cloned())
        .collect();
    out.extend(
        order
            .iter()
            .flat_map(|&i| all[i].iter().filter(|r| is_attach(r)).cloned()),
    );
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
    let next_minor = text
        .lines()
        .filter_map(|l| l.strip_prefix(NEXT_MINOR)?.trim().parse::<u32>().ok())
        .next_back();
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
        let wipe = verb == "message" && req.iter().rev().take(2).eq(["wipe", "key"].iter());
        match (verb, r) {
            ("message", Ok(_)) if wipe => tracing::warn!(
                "device '{name}' is restored suspended, waiting for its dm-crypt key (never recorded): \
                 `dmkit message {name} {} key set HEX` then `dmkit resume {name}`, or \
                 `dmkit exec -- cryptsetup luksResume {name}`",
                req.get(2).map_or("0", String::as_str)
            ),
            ("create", Ok(_)) => devices += 1,
            ("create", Err(e)) => {
                errors.push(format!("device '{name}' not restored: {e}"));
                lost.push(name);
            }
            (_, Ok(_)) => {}
            (_, Err(e)) => errors.push(format!("device '{name}': {verb} not replayed: {e}")),
        }
    }
    if let Some(n) = next_minor {
        ctx.reg.set_next_minor(n);
    }
    if !errors.is_empty() {
        std::fs::copy(path, prev_path(path))?;
    }
    ctx.recorder.record(ctx, path, true)?;
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
        use crate::mapper::{config::Config, Registry};
        Ctx::sandboxed(std::sync::Arc::new(Registry::new(
            Config::default(),
            crate::targets::types(),
        )))
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
        assert_eq!(
            requests(&c),
            vec![vec!["create", "z", "--minor", "0", "--table", "0 8 zero "]]
        );

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

    #[test]
    fn appended_entries_replace_and_remove_devices_and_a_torn_one_is_ignored() {
        let t = "# boot x\n\ncreate\nb\n--table\n0 8 zero\n\ncreate\nc\n--table\n0 8 zero\n\n\
                 attach\nc\n--recover\n1\n\n\
                 # set a\ncreate\na\n--table\n0 8 linear /dev/mapper/z\\ y 0\n\n# end\n\
                 # set z y\ncreate\nz y\n--table\n0 8 zero\n\n# end\n\
                 # del b\n# end\n\
                 # set b\ncreate\nb\n--table\n0 16 zero\n\n# end\n\
                 # set c\ncreate\nc\n--notable\n\n";
        // a after "z y", which its table names; the torn entry for c does not count
        assert_eq!(
            parse(t),
            vec![
                vec!["create", "z y", "--table", "0 8 zero"],
                vec!["create", "a", "--table", "0 8 linear /dev/mapper/z\\ y 0"],
                vec!["create", "b", "--table", "0 16 zero"],
                vec!["create", "c", "--table", "0 8 zero"],
                vec!["attach", "c", "--recover", "1"],
            ]
        );
    }

    #[test]
    fn the_recorder_appends_each_change_and_rewrites_the_whole_record_when_it_has_grown() {
        let dir = std::env::temp_dir().join(format!("dmkit-recorder-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("devices.state");
        let c = ctx();
        let rec = Recorder::default();
        let sorted = |mut v: Vec<Vec<String>>| {
            v.sort();
            v
        };
        let size = || std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        c.reg
            .create("lower", Some("0 64 zero"), false, None)
            .expect("create");
        rec.record(&c, &path, false).expect("record");
        let whole = size();
        for i in 0..20 {
            let n = format!("d{i}");
            c.reg
                .create(&n, Some("0 8 linear /dev/mapper/lower 0"), false, None)
                .expect("create");
            rec.record(&c, &path, false).expect("record");
            if i % 3 == 0 {
                c.reg.remove(&n, false, false).expect("remove");
                rec.record(&c, &path, false).expect("record");
            }
        }
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(
            text.contains(SET) && text.contains(DEL),
            "changes were appended:\n{text}"
        );
        assert_eq!(
            sorted(parse(&text)),
            sorted(requests(&c)),
            "the record says what is there"
        );
        assert_eq!(
            parse(&text)[0][1],
            "lower",
            "the device the others use comes first"
        );
        // a rename is appended as entries for the device under both names and
        // for the devices whose tables name it (they name it anew), whatever
        // the number of other devices
        let before = text.len();
        c.reg.rename("lower", "base").expect("rename");
        rec.record(&c, &path, false).expect("record");
        let text = std::fs::read_to_string(&path).expect("read");
        let added = &text[before..];
        assert!(
            added.contains(&format!("{DEL}lower\n")) && added.contains(&format!("{SET}base\n")),
            "appended:\n{added}"
        );
        assert_eq!(
            added.matches(SET).count(),
            1 + (0..20).filter(|i| i % 3 != 0).count(),
            "base and each device over it:\n{added}"
        );
        let replayed = parse(&text).concat().join(" ");
        assert!(replayed.contains("/dev/mapper/base") && !replayed.contains("/dev/mapper/lower"));
        assert_eq!(sorted(parse(&text)), sorted(requests(&c)));
        assert_eq!(parse(&text)[0][1], "base", "the renamed device still comes first");
        // once the entries outgrow the record, it is written whole again
        let mut rewritten = false;
        for _ in 0..2000 {
            c.reg.message("base", 0, &[]).ok();
            c.reg.resume("d1").expect("resume");
            rec.record(&c, &path, false).expect("record");
            if !std::fs::read_to_string(&path).expect("read").contains(SET) {
                rewritten = true;
                break;
            }
        }
        assert!(
            rewritten,
            "the record was written whole again (size {}, first {whole})",
            size()
        );
        assert!(size() <= REWRITE_AFTER * 3, "the file stays bounded: {}", size());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
