//! lvmd's configuration file, in TopoLVM's YAML: `socket-name` and
//! `device-classes`. A device class here is a dmkit thin pool
//! (`thin-pool.name` names the dmkit device); what lvmd would pass to LVM for
//! thick volumes or lvcreate options has no meaning here and is refused by
//! name rather than ignored.

use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Config {
    /// The unix socket lvmd listens on (TopoLVM's node plugin connects there);
    /// /run/topolvm/lvmd.sock when not given, as lvmd.
    pub socket_name: Option<PathBuf>,
    #[serde(default)]
    pub device_classes: Vec<DeviceClass>,
    /// lvmd's per-request lvcreate options: refused when given (no LVM here).
    #[serde(default)]
    pub lvcreate_option_classes: Vec<serde_norway::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DeviceClass {
    pub name: String,
    /// Optional here: when given, volumes are dmkit devices named as LVM names
    /// them under /dev/mapper (`VG-LV`, dashes doubled).
    pub volume_group: Option<String>,
    #[serde(default)]
    pub default: bool,
    /// Bytes kept back from GetFreeBytes, in GiB (as lvmd).
    pub spare_gb: Option<u64>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub thin_pool: Option<ThinPool>,
    pub stripe: Option<u64>,
    pub stripe_size: Option<String>,
    pub lvcreate_options: Option<Vec<String>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ThinPool {
    /// The dmkit thin-pool device.
    pub name: String,
    #[serde(default = "one")]
    pub overprovision_ratio: f64,
}

fn one() -> f64 {
    1.0
}

/// lvmd's spare default: 10 GiB when `spare-gb` is not given.
const DEFAULT_SPARE_GB: u64 = 10;

impl DeviceClass {
    pub fn pool(&self) -> &ThinPool {
        // `load` refuses a class without one
        self.thin_pool.as_ref().expect("checked at load")
    }

    pub fn spare_bytes(&self) -> u64 {
        self.spare_gb.unwrap_or(DEFAULT_SPARE_GB).saturating_mul(1 << 30)
    }

    /// The dmkit device a volume of this class is: `LV`, or `VG-LV` with the
    /// dashes in each name doubled, as device-mapper names LVM's volumes.
    pub fn device_name(&self, lv: &str) -> String {
        match &self.volume_group {
            Some(vg) => format!("{}-{}", vg.replace('-', "--"), lv.replace('-', "--")),
            None => lv.to_string(),
        }
    }
}

impl Config {
    /// Read and check FILE: an error names the file and what is wrong.
    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Config::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Config, String> {
        let c: Config = serde_norway::from_str(text).map_err(|e| e.to_string())?;
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<(), String> {
        if !self.lvcreate_option_classes.is_empty() {
            return Err(
                "lvcreate-option-classes: not supported (dmkit lvmd makes thin volumes, not lvcreate calls)"
                    .into(),
            );
        }
        if self.device_classes.is_empty() {
            return Err("device-classes: none given".into());
        }
        let mut defaults = 0;
        for (i, dc) in self.device_classes.iter().enumerate() {
            let at = format!("device-classes[{i}] ({})", dc.name);
            if dc.name.is_empty() {
                return Err(format!("device-classes[{i}]: name is empty"));
            }
            if self.device_classes[..i].iter().any(|o| o.name == dc.name) {
                return Err(format!("{at}: name given twice"));
            }
            match dc.kind.as_deref() {
                Some("thin") => {}
                Some("thick") | None => {
                    return Err(format!("{at}: type thick is not supported: dmkit lvmd serves thin device classes (type: thin, thin-pool: {{name: POOL}})"))
                }
                Some(t) => return Err(format!("{at}: unknown type '{t}' (thin)")),
            }
            let Some(tp) = &dc.thin_pool else {
                return Err(format!("{at}: type thin needs thin-pool: {{name: POOL}}"));
            };
            if tp.name.is_empty() {
                return Err(format!("{at}: thin-pool.name is empty"));
            }
            if tp.overprovision_ratio.is_nan() || tp.overprovision_ratio < 1.0 {
                return Err(format!("{at}: thin-pool.overprovision-ratio must be 1.0 or more"));
            }
            for (set, what) in [
                (dc.stripe.is_some(), "stripe"),
                (dc.stripe_size.is_some(), "stripe-size"),
                (dc.lvcreate_options.is_some(), "lvcreate-options"),
            ] {
                if set {
                    return Err(format!(
                        "{at}: {what} is not supported (thin volumes of a dmkit pool)"
                    ));
                }
            }
            if let Some(vg) = &dc.volume_group {
                if vg.is_empty() || vg.contains('/') {
                    return Err(format!("{at}: volume-group '{vg}' is not a name"));
                }
            }
            defaults += usize::from(dc.default);
        }
        if defaults > 1 {
            return Err("device-classes: more than one is default".into());
        }
        Ok(())
    }

    /// The class a request names; "" is the default one.
    pub fn class(&self, name: &str) -> Option<&DeviceClass> {
        if name.is_empty() {
            self.device_classes.iter().find(|d| d.default)
        } else {
            self.device_classes.iter().find(|d| d.name == name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topolvms_thin_class_reads_and_thick_is_refused_by_name() {
        let c = Config::parse(
            "socket-name: /run/topolvm/lvmd.sock\ndevice-classes:\n  - name: ssd-thin\n    volume-group: myvg1\n    default: true\n    spare-gb: 10\n    type: thin\n    thin-pool:\n      name: thinpool\n      overprovision-ratio: 10.0\n",
        )
        .expect("parse");
        let dc = c.class("").expect("default");
        assert_eq!(dc.pool().name, "thinpool");
        assert_eq!(dc.device_name("a-b"), "myvg1-a--b");
        assert_eq!(dc.spare_bytes(), 10 << 30);
        let e = Config::parse("device-classes:\n  - name: ssd\n    volume-group: vg\n    default: true\n")
            .unwrap_err();
        assert!(e.contains("type thick is not supported"), "{e}");
        let e = Config::parse(
            "device-classes:\n  - name: t\n    type: thin\n    thin-pool: {name: p}\n    stripe: 2\n",
        )
        .unwrap_err();
        assert!(e.contains("stripe is not supported"), "{e}");
        let e = Config::parse(
            "device-classes:\n  - name: t\n    type: thin\n    thin-pool: {name: p}\n    colour: red\n",
        )
        .unwrap_err();
        assert!(e.contains("colour"), "{e}");
    }
}
