// The API reference: renders /openapi.json (as the server generates it) into a page.
// No framework and nothing from the network but the document itself.
"use strict";

(function () {
  const reference = document.getElementById("reference");
  const toc = document.getElementById("toc");
  const filter = document.getElementById("filter");
  const METHODS = ["get", "put", "post", "patch", "delete"];
  let spec = null;

  function element(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "class") node.className = value;
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // Backticks become code; everything else stays text (descriptions are never HTML).
  function prose(text) {
    const span = element("span");
    String(text || "").split(/(`[^`]*`)/).forEach((part) => {
      if (part.startsWith("`") && part.endsWith("`") && part.length > 1) span.append(element("code", {}, part.slice(1, -1)));
      else span.append(part);
    });
    return span;
  }

  function resolve(schema) {
    let current = schema;
    for (let depth = 0; current && current.$ref && depth < 20; depth += 1) {
      const path = current.$ref.replace(/^#\//, "").split("/");
      current = path.reduce((node, key) => (node ? node[key] : undefined), spec);
    }
    return current || {};
  }

  function refName(schema) {
    return schema && schema.$ref ? schema.$ref.split("/").pop() : null;
  }

  // One line of constraints: type, format, bounds, pattern, enum.
  function constraints(schema) {
    const resolved = resolve(schema);
    const parts = [];
    const type = Array.isArray(resolved.type) ? resolved.type.join(" | ") : resolved.type;
    if (type) parts.push(type);
    if (resolved.format) parts.push(resolved.format);
    if (resolved.minimum !== undefined) parts.push(`≥ ${resolved.minimum}`);
    if (resolved.maximum !== undefined) parts.push(`≤ ${resolved.maximum}`);
    if (resolved.minLength !== undefined) parts.push(`length ≥ ${resolved.minLength}`);
    if (resolved.maxLength !== undefined) parts.push(`length ≤ ${resolved.maxLength}`);
    if (resolved.minItems !== undefined) parts.push(`items ≥ ${resolved.minItems}`);
    if (resolved.maxItems !== undefined) parts.push(`items ≤ ${resolved.maxItems}`);
    if (resolved.pattern) parts.push(`pattern ${resolved.pattern}`);
    if (resolved.enum) parts.push(`one of ${resolved.enum.map((value) => JSON.stringify(value)).join(", ")}`);
    if (resolved.const !== undefined) parts.push(`= ${JSON.stringify(resolved.const)}`);
    if (resolved.additionalProperties === false) parts.push("no other fields");
    return parts.join(" · ");
  }

  function schemaTree(schema, depth) {
    const name = refName(schema);
    const resolved = resolve(schema);
    const list = element("ul");
    if (depth > 6) return element("span", { class: "muted" }, name || "…");
    for (const key of ["allOf", "oneOf", "anyOf"]) {
      if (resolved[key]) {
        const label = { allOf: "all of", oneOf: "one of", anyOf: "any of" }[key];
        list.append(element("li", {}, element("span", { class: "constraint" }, label),
          element("ul", {}, resolved[key].map((part) => element("li", {}, schemaLine(null, part, false, depth + 1))))));
      }
    }
    if (resolved.properties) {
      const required = new Set(resolved.required || []);
      for (const [property, child] of Object.entries(resolved.properties)) {
        list.append(element("li", {}, schemaLine(property, child, required.has(property), depth + 1)));
      }
    }
    if (resolved.items) list.append(element("li", {}, schemaLine("[ ]", resolved.items, false, depth + 1)));
    if (resolved.additionalProperties && typeof resolved.additionalProperties === "object") {
      list.append(element("li", {}, schemaLine("{ key }", resolved.additionalProperties, false, depth + 1)));
    }
    return list;
  }

  function schemaLine(property, schema, required, depth) {
    const name = refName(schema);
    const resolved = resolve(schema);
    const nested = resolved.properties || resolved.items || resolved.allOf || resolved.oneOf || resolved.anyOf;
    const head = element("span", {},
      property ? element("strong", {}, property) : null,
      property && required ? element("span", { class: "constraint" }, " (required)") : null,
      property ? " " : null,
      name ? element("span", {}, name, " ") : null,
      element("span", { class: "constraint" }, constraints(schema)),
      resolved.description || (schema && schema.description) ? element("span", { class: "muted" }, " — ", prose(resolved.description || schema.description)) : null);
    if (!nested) return head;
    const details = element("details", { open: depth < 2 ? true : null }, element("summary", {}, head), schemaTree(schema, depth));
    return details;
  }

  function security(operation) {
    const schemes = (operation.security || []).flatMap((requirement) => Object.keys(requirement));
    if (schemes.length === 0) return element("p", { class: "small" }, "Open: no credential.");
    const names = { adminToken: "admin", operatorToken: "operator of the shop", serviceKey: "service key of the shop", metricsToken: "metrics token" };
    return element("p", { class: "small" }, "Who may call: ", schemes.map((scheme) => names[scheme] || scheme).join(", "), ".");
  }

  function parameters(operation) {
    if (!operation.parameters || operation.parameters.length === 0) return null;
    return element("table", {},
      element("thead", {}, element("tr", {}, ["Parameter", "In", "Required", "Schema", "Description"].map((title) => element("th", { scope: "col" }, title)))),
      element("tbody", {}, operation.parameters.map((parameter) => element("tr", {},
        element("td", {}, element("code", {}, parameter.name)),
        element("td", {}, parameter.in),
        element("td", {}, parameter.required ? "yes" : "no"),
        element("td", { class: "schema" }, refName(parameter.schema) || "", " ", element("span", { class: "constraint" }, constraints(parameter.schema))),
        element("td", {}, prose(parameter.description))))));
  }

  function content(block) {
    if (!block || !block.content) return null;
    return Object.entries(block.content).map(([mediaType, media]) => element("div", { class: "schema" },
      element("div", { class: "muted small" }, mediaType),
      media.schema ? schemaTree(media.schema, 0) : null));
  }

  function responses(operation) {
    return Object.entries(operation.responses || {}).map(([status, response]) => {
      const resolved = resolve(response);
      const headers = Object.keys(resolved.headers || {});
      return element("details", {},
        element("summary", {}, element("strong", {}, status), " ", prose(resolved.description)),
        headers.length ? element("p", { class: "small muted" }, "Headers: ", headers.join(", ")) : null,
        content(resolved));
    });
  }

  function operationId(method, path) {
    return `${method}-${path}`.replace(/[^A-Za-z0-9_-]+/g, "-");
  }

  function renderOperation(method, path, operation) {
    const description = (operation.description || "").split("\n").filter(Boolean);
    return element("section", { class: "operation", id: operationId(method, path), "data-search": `${method} ${path} ${operation.summary || ""} ${operation.operationId || ""} ${Object.keys(operation.responses || {}).join(" ")}`.toLowerCase() },
      element("h3", {}, element("span", { class: `method ${method}` }, method.toUpperCase()), " ", element("code", {}, path)),
      operation.summary ? element("p", {}, element("strong", {}, prose(operation.summary))) : null,
      description.map((line) => element("p", {}, prose(line))),
      security(operation),
      parameters(operation),
      operation.requestBody ? element("div", {}, element("h4", {}, "Request body", operation.requestBody.required ? "" : " (optional)"), content(operation.requestBody)) : null,
      element("h4", {}, "Responses"),
      responses(operation));
  }

  function render() {
    reference.replaceChildren();
    toc.replaceChildren();
    const info = spec.info || {};
    reference.append(element("h1", {}, `${info.title || "API"} ${info.version || ""}`),
      element("p", {}, prose(info.description)),
      element("p", { class: "small muted" }, `OpenAPI ${spec.openapi}. Errors are application/problem+json with a stable code; every mutating call needs an Idempotency-Key header.`));
    const tags = (spec.tags || []).map((tag) => tag.name);
    const byTag = new Map(tags.map((tag) => [tag, []]));
    for (const [path, item] of Object.entries(spec.paths || {})) {
      for (const method of METHODS) {
        const operation = item[method];
        if (!operation) continue;
        const tag = (operation.tags && operation.tags[0]) || "other";
        if (!byTag.has(tag)) byTag.set(tag, []);
        byTag.get(tag).push([method, path, operation]);
      }
    }
    for (const [tag, operations] of byTag) {
      if (operations.length === 0) continue;
      const described = (spec.tags || []).find((candidate) => candidate.name === tag);
      const section = element("section", { id: `tag-${tag}` }, element("h2", {}, tag), described && described.description ? element("p", { class: "muted" }, described.description) : null);
      const links = element("ul");
      for (const [method, path, operation] of operations) {
        section.append(renderOperation(method, path, operation));
        links.append(element("li", { "data-search": `${method} ${path} ${operation.summary || ""}`.toLowerCase() },
          element("a", { href: `#${operationId(method, path)}` }, element("span", { class: `method ${method}` }, method.toUpperCase()), " ", path)));
      }
      reference.append(section);
      toc.append(element("h3", {}, tag), links);
    }
    const schemas = Object.keys((spec.components && spec.components.schemas) || {}).sort();
    const models = element("section", { id: "schemas" }, element("h2", {}, "Schemas"));
    for (const name of schemas) {
      models.append(element("details", { class: "operation", id: `schema-${name}` }, element("summary", {}, element("strong", {}, name), " ", element("span", { class: "constraint" }, constraints({ $ref: `#/components/schemas/${name}` }))),
        element("div", { class: "schema" }, schemaTree({ $ref: `#/components/schemas/${name}` }, 0))));
    }
    reference.append(models);
    toc.append(element("h3", {}, element("a", { href: "#schemas" }, "Schemas")));
  }

  filter.addEventListener("input", () => {
    const needle = filter.value.trim().toLowerCase();
    document.querySelectorAll("[data-search]").forEach((node) => {
      node.hidden = needle !== "" && !node.getAttribute("data-search").includes(needle);
    });
  });

  fetch("/openapi.json", { headers: { accept: "application/json" } })
    .then((response) => {
      if (!response.ok) throw new Error(`/openapi.json answered ${response.status}`);
      return response.json();
    })
    .then((document) => {
      spec = document;
      render();
      if (location.hash) {
        const target = window.document.getElementById(location.hash.slice(1));
        if (target) target.scrollIntoView();
      }
    })
    .catch((error) => {
      reference.replaceChildren(element("div", { class: "problem" }, `Could not load the API description: ${error.message}`));
    });
})();
