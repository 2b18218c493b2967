//! The night's paperwork, generated from the seed and the date alone: invoices as the suppliers
//! bill them, purchase orders as agreed, and the stock actually received. Exactly
//! `night.mismatches` invoice lines bill more than was received or agreed.

use serde::{Deserialize, Serialize};

use super::night::Night;

/// One supplier that bills the distributor.
#[derive(Debug, Clone, Copy)]
pub struct Supplier {
    /// Short code used in keys and claims.
    pub code: &'static str,
    /// Name printed on invoices.
    pub name: &'static str,
}

/// The suppliers of the stand-in world.
pub const SUPPLIERS: [Supplier; 12] = [
    Supplier {
        code: "SUP01",
        name: "Baltic Timber Ltd",
    },
    Supplier {
        code: "SUP02",
        name: "Nordhavn Fasteners",
    },
    Supplier {
        code: "SUP03",
        name: "Alpine Paints GmbH",
    },
    Supplier {
        code: "SUP04",
        name: "Delta Cables",
    },
    Supplier {
        code: "SUP05",
        name: "Harbour Tiles",
    },
    Supplier {
        code: "SUP06",
        name: "Kestrel Tools",
    },
    Supplier {
        code: "SUP07",
        name: "Lowland Glass",
    },
    Supplier {
        code: "SUP08",
        name: "Meridian Pipes",
    },
    Supplier {
        code: "SUP09",
        name: "Orchard Adhesives",
    },
    Supplier {
        code: "SUP10",
        name: "Pioneer Insulation",
    },
    Supplier {
        code: "SUP11",
        name: "Riverside Hinges",
    },
    Supplier {
        code: "SUP12",
        name: "Summit Lighting",
    },
];

/// One invoice line as billed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BilledLine {
    /// 1-based line number.
    pub line: u32,
    /// Article.
    pub sku: String,
    /// Units billed.
    pub qty: u32,
    /// Price billed per unit, in cents.
    pub unit_price_cents: i64,
}

/// One supplier invoice as it arrives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Invoice {
    /// Invoice number, unique per night.
    pub invoice_no: String,
    /// Supplier code.
    pub supplier: String,
    /// The purchase order it bills.
    pub po_no: String,
    /// The lines.
    pub lines: Vec<BilledLine>,
}

/// One purchase-order line as agreed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderLine {
    /// Purchase order.
    pub po_no: String,
    /// Line number (matches the invoice line).
    pub line: u32,
    /// Article.
    pub sku: String,
    /// Units ordered.
    pub ordered_qty: u32,
    /// Agreed price per unit, in cents.
    pub agreed_price_cents: i64,
}

/// Units received against one purchase-order line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// Purchase order.
    pub po_no: String,
    /// Line number.
    pub line: u32,
    /// Article.
    pub sku: String,
    /// Units received.
    pub received_qty: u32,
}

/// Everything generated for one night.
#[derive(Debug, Clone)]
pub struct World {
    /// The invoices, in arrival order.
    pub invoices: Vec<Invoice>,
    /// The purchase-order lines.
    pub orders: Vec<OrderLine>,
    /// The stock received.
    pub receipts: Vec<Receipt>,
}

/// splitmix64: tiny, fast, and the same everywhere, so the night is reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

fn seed_for(night: &Night) -> u64 {
    // FNV-1a over the date, mixed with the seed: another date is another night.
    let date = night.date.to_string();
    let hash = date.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    hash ^ night.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Generates the night. Same night in, same world out.
pub fn world(night: &Night) -> World {
    let mut rng = Rng(seed_for(night));
    let day = night.date.format("%Y%m%d").to_string();
    let mut invoices = Vec::with_capacity(night.invoices as usize);
    let mut orders = Vec::new();
    for i in 1..=night.invoices {
        let supplier = SUPPLIERS[rng.range(0, SUPPLIERS.len() as u64 - 1) as usize]
            .code
            .to_owned();
        let po_no = format!("PO-{day}-{i:04}");
        let first_sku = rng.range(1, 9_000);
        let lines: Vec<BilledLine> = (1..=rng.range(1, 4) as u32)
            .map(|line| BilledLine {
                line,
                sku: format!("SKU-{:04}", first_sku + u64::from(line) * 7),
                qty: rng.range(1, 48) as u32,
                unit_price_cents: rng.range(95, 12_000) as i64,
            })
            .collect();
        orders.extend(lines.iter().map(|l| OrderLine {
            po_no: po_no.clone(),
            line: l.line,
            sku: l.sku.clone(),
            ordered_qty: l.qty,
            agreed_price_cents: l.unit_price_cents,
        }));
        invoices.push(Invoice {
            invoice_no: format!("INV-{day}-{i:04}"),
            supplier,
            po_no,
            lines,
        });
    }
    let mut receipts: Vec<Receipt> = orders
        .iter()
        .map(|o| Receipt {
            po_no: o.po_no.clone(),
            line: o.line,
            sku: o.sku.clone(),
            received_qty: o.ordered_qty,
        })
        .collect();
    spoil(
        &mut rng,
        night.mismatches as usize,
        &mut invoices,
        &mut receipts,
    );
    World {
        invoices,
        orders,
        receipts,
    }
}

/// Makes `count` distinct lines over-bill: either fewer units arrived than billed, or the billed
/// price is above the agreed one. Orders and receipts share one index, line for line.
fn spoil(rng: &mut Rng, count: usize, invoices: &mut [Invoice], receipts: &mut [Receipt]) {
    let mut positions: Vec<(usize, usize, usize)> = Vec::new();
    for (i, inv) in invoices.iter().enumerate() {
        for l in 0..inv.lines.len() {
            positions.push((i, l, positions.len()));
        }
    }
    // Fisher-Yates, seeded: the same lines are spoiled every time.
    for k in (1..positions.len()).rev() {
        positions.swap(k, rng.range(0, k as u64) as usize);
    }
    for &(i, l, flat) in positions.iter().take(count) {
        let billed = &mut invoices[i].lines[l];
        if rng.next() & 1 == 0 {
            let short = rng.range(1, u64::from(billed.qty.div_ceil(3))) as u32;
            receipts[flat].received_qty = billed.qty - short;
        } else {
            billed.unit_price_cents +=
                rng.range(5, (billed.unit_price_cents as u64 / 8).max(5)) as i64;
        }
    }
}

/// The supplier with this code.
pub fn supplier(code: &str) -> Option<&'static Supplier> {
    SUPPLIERS.iter().find(|s| s.code == code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::night::parse_date;

    fn default_night() -> Night {
        Night::new(parse_date("2026-10-13").unwrap())
    }

    #[test]
    fn the_default_night_has_312_invoices_and_40_over_billed_lines() {
        let w = world(&default_night());
        assert_eq!(w.invoices.len(), 312);
        let billed = w.invoices.iter().flat_map(|inv| inv.lines.iter());
        let over = billed
            .zip(w.orders.iter().zip(&w.receipts))
            .filter(|(b, (o, r))| {
                b.qty > r.received_qty || b.unit_price_cents > o.agreed_price_cents
            })
            .count();
        assert_eq!(over, 40);
    }

    #[test]
    fn same_night_same_world_other_date_other_world() {
        let a = world(&default_night());
        let b = world(&default_night());
        assert_eq!(a.invoices, b.invoices);
        assert_eq!(a.receipts, b.receipts);
        let other = world(&Night::new(parse_date("2026-10-14").unwrap()));
        assert_ne!(a.invoices, other.invoices);
    }
}
