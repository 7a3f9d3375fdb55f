//! dmsetup's report-style output: `info -c` columns, `deps` and `ls --tree`.

use super::errors::ControlError;
use super::DevRef;
use super::Registry;
use super::{Device, DM_MAJOR};
use crate::sync::Unpoison;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One `info -c` field: its `-o` name, heading, minimum width, alignment.
struct Field {
    key: &'static str,
    heading: &'static str,
    width: usize,
    right: bool,
    value: fn(&Device) -> String,
}

const FIELDS: &[Field] = &[
    Field {
        key: "name",
        heading: "Name",
        width: 16,
        right: false,
        value: |d| d.name(),
    },
    Field {
        key: "uuid",
        heading: "UUID",
        width: 32,
        right: false,
        value: |d| d.uuid().unwrap_or_default(),
    },
    Field {
        key: "attr",
        heading: "Stat",
        width: 4,
        right: false,
        value: attr,
    },
    Field {
        key: "tables_loaded",
        heading: "Tables",
        width: 6,
        right: false,
        value: |d| {
            let live = d.live.load().is_some();
            let inactive = d.inactive.lock().unpoisoned().is_some();
            match (live, inactive) {
                (true, true) => "Live & Inactive",
                (true, false) => "Live",
                (false, true) => "Inactive",
                (false, false) => "None",
            }
            .into()
        },
    },
    Field {
        key: "suspended",
        heading: "Suspended",
        width: 9,
        right: false,
        value: |d| yes_no(d.suspended.load(Ordering::SeqCst), "Suspended", "Active"),
    },
    Field {
        key: "readonly",
        heading: "RO",
        width: 2,
        right: false,
        value: |d| yes_no(d.read_only(), "Read-only", "Writeable"),
    },
    Field {
        key: "deferred_remove",
        heading: "DefRm",
        width: 5,
        right: false,
        value: |d| yes_no(d.deferred_remove.load(Ordering::SeqCst), "Deferred remove", ""),
    },
    Field {
        key: "major",
        heading: "Maj",
        width: 3,
        right: true,
        value: |_| DM_MAJOR.to_string(),
    },
    Field {
        key: "minor",
        heading: "Min",
        width: 3,
        right: true,
        value: |d| d.minor.to_string(),
    },
    Field {
        key: "open",
        heading: "Open",
        width: 4,
        right: true,
        value: |d| open_count(d).to_string(),
    },
    Field {
        key: "segments",
        heading: "Targ",
        width: 4,
        right: true,
        value: |d| d.live.load().as_ref().map_or(0, |t| t.entries.len()).to_string(),
    },
    Field {
        key: "events",
        heading: "Event",
        width: 6,
        right: true,
        value: |d| d.events().to_string(),
    },
    Field {
        key: "read_ahead",
        heading: "RAhead",
        width: 6,
        right: true,
        value: |d| d.limits().read_ahead_sectors().to_string(),
    },
    Field {
        key: "devno",
        heading: "DevNo",
        width: 5,
        right: false,
        value: |d| format!("{DM_MAJOR}:{}", d.minor),
    },
    Field {
        key: "blkdevname",
        heading: "BlkDevName",
        width: 16,
        right: false,
        value: |d| format!("dm-{}", d.minor),
    },
    Field {
        key: "device_count",
        heading: "#Devs",
        width: 5,
        right: true,
        value: |d| used(d).len().to_string(),
    },
    Field {
        key: "devs_used",
        heading: "DevNamesUsed",
        width: 16,
        right: false,
        value: |d| used(d).into_iter().map(|u| u.name).collect::<Vec<_>>().join(","),
    },
    Field {
        key: "devnos_used",
        heading: "DevNosUsed",
        width: 16,
        right: false,
        value: |d| used(d).into_iter().map(|u| u.devno).collect::<Vec<_>>().join(","),
    },
];

/// `info -c -o help`: the fields `-o` takes, with their headings.
pub(super) fn fields_help() -> String {
    let mut out = String::from(
        "Device-mapper info fields (-o takes a comma-separated list; +F adds to the default):\n",
    );
    for f in FIELDS {
        let _ = writeln!(out, "  {:<16} {}", f.key, f.heading);
    }
    let _ = writeln!(out, "Default: {DEFAULT_FIELDS}");
    out
}

/// The fields `info -c` prints without `-o`.
const DEFAULT_FIELDS: &str = "name,major,minor,attr,open,segments,events,uuid";

fn yes_no(b: bool, yes: &str, no: &str) -> String {
    if b { yes } else { no }.to_string()
}

/// What a device's open count reports: its openers and the tables holding it.
pub(crate) fn open_count(d: &Device) -> u32 {
    d.settled_open_count() + d.holders.load(Ordering::SeqCst)
}

/// `Stat`: (L)ive table, (I)nactive table, (s)uspended, (r)ead-only or (w)ritable.
fn attr(d: &Device) -> String {
    let live = d.live.load().is_some();
    let inactive = d.inactive.lock().unpoisoned().is_some();
    [
        if live { 'L' } else { '-' },
        if inactive { 'I' } else { '-' },
        if d.suspended.load(Ordering::SeqCst) {
            's'
        } else {
            '-'
        },
        if d.read_only() { 'r' } else { 'w' },
    ]
    .iter()
    .collect()
}

/// A field name as dmsetup matches it: without case or underscores.
fn canonical(k: &str) -> String {
    k.chars()
        .filter(|&c| c != '_')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// The fields named by `-o` (`+f,...` adds to the default set), or the default set.
pub(super) fn fields(spec: Option<&str>) -> Result<Vec<usize>, ControlError> {
    let spec = match spec {
        None => DEFAULT_FIELDS.to_string(),
        Some(s) => match s.strip_prefix('+') {
            Some(more) => format!("{DEFAULT_FIELDS},{more}"),
            None => s.to_string(),
        },
    };
    let mut out = Vec::new();
    for k in spec.split(',').map(str::trim).filter(|k| !k.is_empty()) {
        let i = FIELDS
            .iter()
            .position(|f| canonical(f.key) == canonical(k))
            .ok_or_else(|| {
                let known: Vec<&str> = FIELDS.iter().map(|f| f.key).collect();
                ControlError::Usage(format!("Unrecognised field: {k} (fields: {})", known.join(", ")))
            })?;
        out.push(i);
    }
    if out.is_empty() {
        return Err(ControlError::Usage("no fields given to -o".into()));
    }
    Ok(out)
}

/// Aligned columns, as dmsetup's report prints them: each as wide as its minimum or
/// its widest value, numbers right-aligned, everything else (headings too)
/// left-aligned, every column padded. With a separator, or without headings
/// (which means ':'), fields are joined unaligned.
pub(super) fn columns(
    devs: &[Arc<Device>],
    fields: &[usize],
    headings: bool,
    separator: Option<&str>,
) -> String {
    let separator = separator.or((!headings).then_some(":"));
    let rows: Vec<Vec<String>> = devs
        .iter()
        .map(|d| fields.iter().map(|&i| (FIELDS[i].value)(d)).collect())
        .collect();
    let mut out = String::new();
    if let Some(sep) = separator {
        if headings {
            let h: Vec<&str> = fields.iter().map(|&i| FIELDS[i].heading).collect();
            let _ = writeln!(out, "{}", h.join(sep));
        }
        for r in rows {
            let _ = writeln!(out, "{}", r.join(sep));
        }
        return out;
    }
    let widths: Vec<usize> = fields
        .iter()
        .enumerate()
        .map(|(c, &i)| {
            let f = &FIELDS[i];
            rows.iter()
                .map(|r| r[c].len())
                .chain([f.width, f.heading.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |out: &mut String, cells: &[String], heading: bool| {
        let mut l = String::new();
        for (c, cell) in cells.iter().enumerate() {
            let f = &FIELDS[fields[c]];
            if c > 0 {
                l.push(' ');
            }
            let w = widths[c];
            if f.right && !heading {
                let _ = write!(l, "{cell:>w$}");
            } else {
                let _ = write!(l, "{cell:<w$}");
            }
        }
        let _ = writeln!(out, "{l}");
    };
    if headings {
        let h: Vec<String> = fields.iter().map(|&i| FIELDS[i].heading.to_string()).collect();
        line(&mut out, &h, true);
    }
    for r in &rows {
        line(&mut out, r, false);
    }
    out
}

/// A device a table maps onto, as dmsetup names it.
struct Used {
    /// The dm name, or the device's path (a file has no number).
    name: String,
    /// `major:minor`, or the path of a regular file.
    devno: String,
    /// `(major, minor)` as `deps` prints it.
    deps: String,
    dm: Option<Arc<Device>>,
}

/// The distinct devices `d`'s live table maps onto, most recently added first, as
/// the kernel's table keeps them.
fn used(d: &Device) -> Vec<Used> {
    match d.live.load_full() {
        Some(t) => used_in(&t),
        None => Vec::new(),
    }
}

/// The device numbers a table maps onto, as the kernel's `retrieve_deps` lists
/// them (the dm ioctl door's TABLE_DEPS); a regular file, which has none, is
/// (0, 0).
pub fn dep_numbers(t: &super::Table) -> Vec<(u32, u32)> {
    used_in(t)
        .iter()
        .map(|u| match u.devno.split_once(':') {
            Some((a, b)) => (a.parse().unwrap_or(0), b.parse().unwrap_or(0)),
            None => (0, 0),
        })
        .collect()
}

fn used_in(t: &super::Table) -> Vec<Used> {
    let mut out: Vec<Used> = Vec::new();
    for e in &t.entries {
        for r in e.target.held_devices() {
            let u = match r {
                DevRef::Dm(h) => Used {
                    name: h.0.name(),
                    devno: format!("{DM_MAJOR}:{}", h.0.minor),
                    deps: format!("({DM_MAJOR}, {})", h.0.minor),
                    dm: Some(h.0.clone()),
                },
                DevRef::File(f) => match f.rdev {
                    Some((ma, mi)) => Used {
                        name: f.path.display().to_string(),
                        devno: format!("{ma}:{mi}"),
                        deps: format!("({ma}, {mi})"),
                        dm: None,
                    },
                    None => Used {
                        name: f.path.display().to_string(),
                        devno: f.path.display().to_string(),
                        deps: format!("({})", f.path.display()),
                        dm: None,
                    },
                },
            };
            if !out.iter().any(|o| o.devno == u.devno) {
                out.insert(0, u);
            }
        }
    }
    out
}

/// One device's `deps` line: `N dependencies\t: (major, minor) ...`, prefixed by
/// `name: ` when every device is listed.
pub(super) fn deps(d: &Device, prefix: bool) -> String {
    let mut line = if prefix {
        format!("{}: ", d.name())
    } else {
        String::new()
    };
    let u = used(d);
    let _ = write!(line, "{} dependencies\t:", u.len());
    for x in &u {
        let _ = write!(line, " {}", x.deps);
    }
    line.push('\n');
    line
}

/// `ls --tree`: each device not used by another as a root, the devices it maps
/// onto below it, drawn as dmsetup draws it in the C locale.
pub(super) fn tree(devs: &[Arc<Device>]) -> String {
    // Every dm device some listed device maps onto, found once.
    let below: Vec<Arc<Device>> = devs.iter().flat_map(|d| used(d)).filter_map(|u| u.dm).collect();
    let mut out = String::new();
    for d in devs.iter().filter(|d| !below.iter().any(|b| Arc::ptr_eq(b, d))) {
        let _ = writeln!(out, "{} ({DM_MAJOR}:{})", d.name(), d.minor);
        branch(&mut out, d, " ", 0);
    }
    out
}

fn branch(out: &mut String, d: &Device, indent: &str, depth: u32) {
    if depth > 16 {
        return;
    }
    let u = used(d);
    for (i, child) in u.iter().enumerate() {
        let last = i + 1 == u.len();
        let (stem, more) = if last { ("`-", "   ") } else { ("|-", "|  ") };
        match &child.dm {
            Some(c) => {
                let _ = writeln!(out, "{indent}{stem}{} ({DM_MAJOR}:{})", c.name(), c.minor);
                branch(out, c, &format!("{indent}{more}"), depth + 1);
            }
            None => {
                let _ = writeln!(out, "{indent}{stem} ({})", child.devno);
            }
        }
    }
}

/// dmsetup's queries (`table`, `status`, `info`, `ls`, `deps`, `targets`):
/// what the registry holds, as text.
impl Registry {
    /// The named device, or every device; None when there are none.
    fn selected(&self, name: Option<&str>) -> Result<Option<Vec<Arc<Device>>>, ControlError> {
        let devs = match name {
            Some(n) => vec![self.get(n)?],
            None => self.list(),
        };
        Ok((!devs.is_empty()).then_some(devs))
    }

    /// `dmsetup table|status [NAME]`: `<start> <len> <type> <params>` per target.
    /// `--inactive`: the loaded table that resume would make live. Keys are
    /// zeroed unless `keys` (`dmsetup table --showkeys`).
    pub fn table_lines(
        &self,
        name: Option<&str>,
        status: bool,
        inactive: bool,
        keys: bool,
    ) -> Result<String, ControlError> {
        let Some(devs) = self.selected(name)? else {
            return Ok("No devices found\n".into());
        };
        let mut out = String::new();
        for d in devs {
            let prefix = if name.is_none() {
                format!("{}: ", d.name())
            } else {
                String::new()
            };
            let table = if inactive {
                d.inactive.lock().unpoisoned().clone()
            } else {
                d.live.load_full()
            };
            let Some(t) = table else {
                if name.is_none() {
                    let _ = writeln!(out, "{prefix}");
                }
                continue;
            };
            for e in &t.entries {
                let params = if status {
                    e.target.status_params()
                } else if keys {
                    e.target.table_params()
                } else {
                    e.target
                        .table_params_keyless()
                        .unwrap_or_else(|| e.target.table_params())
                };
                let _ = writeln!(
                    out,
                    "{prefix}{} {} {} {params}",
                    e.start,
                    e.len,
                    e.target.type_name()
                );
            }
        }
        Ok(out)
    }

    /// `dmsetup info [NAME]` in the long form.
    pub fn info(&self, name: Option<&str>) -> Result<String, ControlError> {
        let Some(devs) = self.selected(name)? else {
            return Ok("No devices found\n".into());
        };
        let mut out = String::new();
        for d in devs {
            let live = d.live.load().is_some();
            let inactive = d.inactive.lock().unpoisoned().is_some();
            let mut state = if d.suspended.load(Ordering::SeqCst) {
                "SUSPENDED"
            } else {
                "ACTIVE"
            }
            .to_string();
            if d.read_only() {
                state.push_str(" (READ-ONLY)");
            }
            if d.deferred_remove.load(Ordering::SeqCst) {
                state.push_str(" (DEFERRED REMOVE)");
            }
            let tables = match (live, inactive) {
                (false, false) => "None",
                (true, false) => "LIVE",
                (false, true) => "INACTIVE",
                (true, true) => "LIVE & INACTIVE",
            };
            let targets = d.live.load().as_ref().map_or(0, |t| t.entries.len());
            let opens = d.open_count.load(Ordering::SeqCst) + d.holders.load(Ordering::SeqCst);
            let row = |out: &mut String, k: &str, v: String| {
                let _ = writeln!(out, "{:<19}{v}", format!("{k}:"));
            };
            row(&mut out, "Name", d.name());
            row(&mut out, "State", state);
            row(
                &mut out,
                "Read Ahead",
                d.limits().read_ahead_sectors().to_string(),
            );
            row(&mut out, "Tables present", tables.into());
            row(&mut out, "Open count", opens.to_string());
            row(&mut out, "Event number", d.events().to_string());
            row(&mut out, "Major, minor", format!("{DM_MAJOR}, {}", d.minor));
            row(&mut out, "Number of targets", targets.to_string());
            if let Some(b) = d.block_device() {
                row(&mut out, "Block device", b);
            }
            if let Some(u) = &d.uuid() {
                let _ = writeln!(out, "UUID: {u}");
            }
            out.push('\n');
        }
        Ok(out)
    }

    /// `dmsetup ls [--target T] [--tree]`.
    pub fn ls(&self, tree: bool, target: Option<&str>) -> String {
        let devs: Vec<Arc<Device>> = self
            .list()
            .into_iter()
            .filter(|d| target.is_none_or(|t| has_target(d, t)))
            .collect();
        if devs.is_empty() {
            return "No devices found\n".into();
        }
        if tree {
            return self::tree(&devs);
        }
        // dmsetup prints the number as `(major, minor)` when it lists by target
        // type (it goes through its status path) and `(major:minor)` otherwise
        let sep = if target.is_some() { ", " } else { ":" };
        devs.iter()
            .map(|d| match d.block_device() {
                Some(b) => format!("{}\t({DM_MAJOR}{sep}{})\t{b}\n", d.name(), d.minor),
                None => format!("{}\t({DM_MAJOR}{sep}{})\n", d.name(), d.minor),
            })
            .collect()
    }

    /// `dmsetup deps [NAME]`: the devices each device's live table maps onto.
    pub fn deps(&self, name: Option<&str>) -> Result<String, ControlError> {
        let Some(devs) = self.selected(name)? else {
            return Ok("No devices found\n".into());
        };
        Ok(devs.iter().map(|d| deps(d, name.is_none())).collect())
    }

    /// `dmsetup info -c [-o FIELDS] [--noheadings] [--separator S]`.
    pub fn info_columns(
        &self,
        name: Option<&str>,
        fields: Option<&str>,
        headings: bool,
        separator: Option<&str>,
    ) -> Result<String, ControlError> {
        if fields.is_some_and(|f| f.trim().eq_ignore_ascii_case("help")) {
            return Ok(fields_help());
        }
        let fields = self::fields(fields)?;
        let Some(devs) = self.selected(name)? else {
            return Ok("No devices found\n".into());
        };
        Ok(columns(&devs, &fields, headings, separator))
    }

    /// `dmkit stats NAME`: the backing files under a device (through stacked
    /// devices), the flushes and the FUA writes each has received.
    pub fn stats(&self, name: &str) -> Result<String, ControlError> {
        let dev = self.get(name)?;
        let mut files = Vec::new();
        super::collect_files(&dev, &mut files, 0);
        Ok(files
            .iter()
            .map(|f| {
                format!(
                    "{} flushes={} fua_writes={}\n",
                    f.path.display(),
                    f.flushes.load(Ordering::Relaxed),
                    f.fua_writes.load(Ordering::Relaxed)
                )
            })
            .collect())
    }

    /// `dmsetup targets`.
    pub fn targets(&self) -> String {
        self.target_types()
            .iter()
            .map(|t| {
                format!(
                    "{:<16} v{}.{}.{}\n",
                    t.name, t.version[0], t.version[1], t.version[2]
                )
            })
            .collect()
    }
}

/// Whether `d`'s live table has a target of type `t`.
fn has_target(d: &Device, t: &str) -> bool {
    d.live
        .load()
        .as_ref()
        .is_some_and(|tb| tb.entries.iter().any(|e| e.target.type_name() == t))
}
